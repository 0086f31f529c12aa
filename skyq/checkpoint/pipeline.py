"""The streaming loop every converter runs: read shard -> transform its tensors -> write (and hash).

Work is spread per TENSOR, not per shard: the reader queues every tensor of a shard as a task, the
converter threads take tasks in order, and the shard goes to the writer as soon as its last tensor
is done. So both converter threads work on the same shard while the writer writes the previous
one, and the end of a run waits for one shard's tensors shared out, not for a whole shard on one
thread (with ~5 shards and 2 threads that tail was a third of the run). Torch kernels, file I/O
and hashing release the GIL. Memory: at most `max_workers + writers` shards are read and not yet
written. On a GPU (`device`, see `skyq.checkpoint.device`) the reader also uploads each shard, the
converter threads quantize on their own CUDA streams and copy the results back, and several writer
threads write and hash finished shards side by side (there the CPU work is writing and sha256, not
quantizing; on the CPU one writer leaves the cores to the converters). Every shard is written
crash-safely on its own and the done-log is sorted, so the writer count never changes the output.
The first error in any stage stops the others and is re-raised in the caller; whatever shard was
being written is left only as a temp file, which the next run deletes.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
from collections.abc import Callable, Container
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from skyq.checkpoint.device import DeviceStage
from skyq.checkpoint.output import ConversionOutput
from skyq.checkpoint.reader import ShardedCheckpoint
from skyq.quant.errors import check_finite


@dataclass
class ShardResult:
    """What a transform made of (some tensors of) one input shard."""

    tensors: dict[str, torch.Tensor]
    converted: int = 0
    """Tensors quantized or dequantized."""
    kept: int = 0
    """Tensors copied unchanged."""


# transform(shard, all its tensors, names) -> the result for `names` only (other tensors of the
# shard, e.g. a weight's scale, may be read but are not emitted).
ShardTransform = Callable[[str, dict[str, torch.Tensor], list[str]], ShardResult]


def check_kept_finite(name: str, tensor: torch.Tensor) -> None:
    """Tensors copied unchanged must be finite too: a NaN norm weight is as fatal as a NaN linear."""
    if tensor.is_floating_point():
        check_finite(tensor, name)  # a sum first; the element check only when the sum is not finite


def tensorwise_transform(
    convert: Callable[[str, dict[str, torch.Tensor]], dict[str, torch.Tensor]],
    *,
    converts: Container[str],
    consumed: Container[str] = frozenset(),
) -> ShardTransform:
    """The transform every converter runs: each name in `converts` becomes
    `convert(name, shard tensors)` (its output tensors), a `consumed` name (a scale the conversion
    reads) is dropped, and every other tensor is kept unchanged once it is checked finite."""

    def transform(shard: str, tensors: dict[str, torch.Tensor], names: list[str]) -> ShardResult:
        result = ShardResult(tensors={})
        for name in names:
            if name in converts:
                result.tensors.update(convert(name, tensors))
                result.converted += 1
            elif name not in consumed:
                check_kept_finite(name, tensors[name])
                result.tensors[name] = tensors[name]
                result.kept += 1
        return result

    return transform


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
_CPU = torch.device("cpu")
GPU_WRITERS = 4
"""Writer threads when converting on a GPU: sha256 and file writes of several shards at once."""


@dataclass
class _ShardWork:
    """One shard in flight: its input tensors, the tensors still to convert, the merged result."""

    shard: str
    tensors: dict[str, torch.Tensor]
    pending: int
    ready: object | None = None
    """CUDA event of the shard's upload (None on the CPU)."""
    result: ShardResult = field(default_factory=lambda: ShardResult(tensors={}))


def _get(q: queue.Queue, stop: threading.Event) -> object:
    """The next item, or `_DONE` as soon as any stage failed."""
    while not stop.is_set():
        try:
            return q.get(timeout=0.05)
        except queue.Empty:
            continue
    return _DONE


def run_conversion(
    *, source: ShardedCheckpoint, output: ConversionOutput, shards: list[str], transform: ShardTransform,
    max_workers: int = 1, tool: str, device: torch.device = _CPU, writers: int | None = None,
) -> ConversionStats:  # fmt: skip
    """Convert every shard of `shards` not already done in `output` on `device`; returns the run's
    statistics. `writers`: writer threads (None: `GPU_WRITERS` on a GPU, 1 on the CPU)."""
    stats = ConversionStats()
    todo = [s for s in shards if s not in output.done]
    stats.shards_resumed = len(shards) - len(todo)
    workers = max(1, max_workers)
    n_writers = max(1, writers if writers is not None else (GPU_WRITERS if device.type == "cuda" else 1))
    stage = DeviceStage(device)
    stop, lock = threading.Event(), threading.Lock()
    in_flight = threading.Semaphore(workers + n_writers)  # shards read and not yet written
    unclaimed = [len(todo)]  # shards no writer has taken yet
    tasks: queue.Queue = queue.Queue()  # (shard work, tensor name); bounded by `in_flight`
    to_write: queue.Queue = queue.Queue()
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
            while not in_flight.acquire(timeout=0.05):
                if stop.is_set():
                    return
            tensors, ready = stage.upload(source.read_shard(shard))
            work = _ShardWork(shard, tensors, pending=len(tensors), ready=ready)
            if not tensors:
                to_write.put(work)
            for name in sorted(tensors):
                tasks.put((work, name))
        for _ in range(workers):
            tasks.put(_DONE)

    def convert() -> None:
        while (item := _get(tasks, stop)) is not _DONE:
            work, name = item
            with stage.converting(work.ready):
                part = transform(work.shard, work.tensors, [name])
                part.tensors = stage.download(part.tensors)
            with lock:
                work.result.tensors.update(part.tensors)
                work.result.converted += part.converted
                work.result.kept += part.kept
                work.pending -= 1
                finished = work.pending == 0
            if finished:
                work.tensors = {}  # drop the input (mapped file pages) before the write
                to_write.put(work)

    def write() -> None:
        while True:
            with lock:
                if unclaimed[0] == 0:
                    return
                unclaimed[0] -= 1
            work = _get(to_write, stop)
            if work is _DONE:
                return
            nbytes = 0
            if work.result.tensors:
                nbytes = output.write_shard(work.shard, work.result.tensors)
            else:
                output.mark_empty(work.shard)
            with lock:
                stats.bytes_out += nbytes
                stats.converted += work.result.converted
                stats.kept += work.result.kept
                stats.bytes_in += source.shard_bytes(work.shard)
                stats.shards_written += 1
                overall.update(source.shard_bytes(work.shard))
            del work
            in_flight.release()

    # Converter threads run torch single-threaded; `max_workers` is the parallelism. On a shared
    # 2-core machine intra-op threads made the quantizers several times slower (a stolen core stalls
    # every parallel op; docs/benchmarks.md, M6 converters), and the read/write threads need a core
    # slice of their own.
    intra_op_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    start = time.perf_counter()
    threads = [threading.Thread(target=guarded(read), name="skyq-read")]
    threads += [threading.Thread(target=guarded(convert), name=f"skyq-convert-{i}") for i in range(workers)]
    threads += [threading.Thread(target=guarded(write), name=f"skyq-write-{i}") for i in range(n_writers)]
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
