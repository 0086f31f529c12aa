"""The streaming loop every converter runs: read shard -> transform -> write (and hash).

Three stages on threads joined by bounded queues, so reading shard i+1, converting shard i and
writing shard i-1 overlap (torch kernels, file I/O and hashing release the GIL). Memory stays at
about one shard per converter thread plus the one being read and the one being written.
The first error in any stage stops the others and is re-raised in the caller; whatever shard was
being written is left only as a temp file, which the next run deletes.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from skyq.checkpoint.output import ConversionOutput
from skyq.checkpoint.reader import ShardedCheckpoint


@dataclass
class ShardResult:
    """What a transform made of one input shard."""

    tensors: dict[str, torch.Tensor]
    converted: int = 0
    """Tensors quantized or dequantized."""
    kept: int = 0
    """Tensors copied unchanged."""


# transform(shard, its tensors, tick) -> result; `tick()` once per tensor drives the shard's bar.
ShardTransform = Callable[[str, dict[str, torch.Tensor], Callable[[], None]], ShardResult]


@dataclass
class ConversionStats:
    shards_written: int = 0
    shards_resumed: int = 0
    converted: int = 0
    kept: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    seconds: float = 0.0
    errors: list[BaseException] = field(default_factory=list)

    def summary(self, tool: str) -> str:
        gbps = self.bytes_in / max(self.seconds, 1e-9) / 1e9
        return (
            f"{tool}: {self.converted} tensors converted, {self.kept} kept as is, "
            f"{self.shards_written} shards written ({self.shards_resumed} already done), "
            f"{self.bytes_in / 1e9:.3f} GB in, {self.bytes_out / 1e9:.3f} GB out, "
            f"{self.seconds:.2f} s, {gbps:.3f} GB/s"
        )


_DONE = object()


class _Stage:
    """Bounded hand-off between threads that gives up as soon as any stage failed."""

    def __init__(self, stop: threading.Event) -> None:
        self.q: queue.Queue = queue.Queue(maxsize=1)
        self.stop = stop

    def put(self, item: object) -> bool:
        while not self.stop.is_set():
            try:
                self.q.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def get(self) -> object:
        while not self.stop.is_set():
            try:
                return self.q.get(timeout=0.05)
            except queue.Empty:
                continue
        return _DONE


def run_conversion(
    *, source: ShardedCheckpoint, output: ConversionOutput, shards: list[str], transform: ShardTransform,
    max_workers: int = 1, tool: str,
) -> ConversionStats:  # fmt: skip
    """Convert every shard of `shards` not already done in `output`; returns the run's statistics."""
    stats = ConversionStats()
    todo = [s for s in shards if s not in output.done]
    stats.shards_resumed = len(shards) - len(todo)
    workers = max(1, max_workers)
    stop, lock = threading.Event(), threading.Lock()
    to_convert, to_write = _Stage(stop), _Stage(stop)
    overall = tqdm(
        total=sum(source.shard_bytes(s) for s in todo), unit="B", unit_scale=True, desc=tool,
        disable=None, file=sys.stderr,
    )  # fmt: skip

    def guarded(fn: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                fn()
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller
                with lock:
                    stats.errors.append(e)
                stop.set()

        return run

    def read() -> None:
        for shard in todo:
            if not to_convert.put((shard, source.read_shard(shard))):
                return
        for _ in range(workers):
            to_convert.put(_DONE)

    def convert() -> None:
        while (item := to_convert.get()) is not _DONE:
            shard, tensors = item
            with tqdm(total=len(tensors), desc=shard, leave=False, disable=None, file=sys.stderr) as bar:
                result = transform(shard, tensors, bar.update)
            del tensors
            with lock:
                stats.converted += result.converted
                stats.kept += result.kept
            if not to_write.put((shard, result.tensors)):
                return
        to_write.put(_DONE)

    def write() -> None:
        finished = 0
        while finished < workers:
            item = to_write.get()
            if item is _DONE:
                if stop.is_set():
                    return
                finished += 1
                continue
            shard, tensors = item
            if tensors:
                stats.bytes_out += output.write_shard(shard, tensors)
            else:
                output.mark_empty(shard)
            del tensors, item
            stats.bytes_in += source.shard_bytes(shard)
            stats.shards_written += 1
            overall.update(source.shard_bytes(shard))

    # Converter threads run torch single-threaded; `max_workers` is the parallelism. On a shared
    # 2-core machine intra-op threads made the quantizers up to 5x slower (a stolen core stalls
    # every parallel op), and the read/write threads need a core slice of their own.
    intra_op_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    start = time.perf_counter()
    threads = [threading.Thread(target=guarded(read), name="skyq-read")]
    threads += [threading.Thread(target=guarded(convert), name=f"skyq-convert-{i}") for i in range(workers)]
    threads.append(threading.Thread(target=guarded(write), name="skyq-write"))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    overall.close()
    torch.set_num_threads(intra_op_threads)
    stats.seconds = time.perf_counter() - start
    if stats.errors:
        raise stats.errors[0]
    return stats
