"""Two processes, two GPUs, the real `TorchDistChannel` over NCCL: run with `python -m tests.sync.nccl_check`.

Needs only torch and two CUDA devices (no Ray, no pytest), so it runs on a bare GPU box; the
gpu-marked test in test_nccl_transport.py calls `main()`. Sends the plain-tensor wire fixtures (e4m3,
fp32, uint8, int32, bf16, int64) from cuda:0 to cuda:1 and checks every byte, then times a larger
bf16 payload.
"""

from __future__ import annotations

import time

import torch
import torch.multiprocessing as mp

from skyq.sync.receiver import ExpectedUnit, WeightReceiver
from skyq.sync.sender import WeightSender
from skyq.sync.torch_dist import RECEIVER_RANK, SENDER_RANK, TorchDistChannel, connect_store, open_store

from .ray_peers import sha256, weights_for
from .wire_fixtures import DictEngine, expected_units, fp8_like_serialize

TIMEOUT_S = 60.0
BIG_TENSORS, BIG_SHAPE = 8, (4096, 4096)  # 8 x 32 MiB of bf16


def _big(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        f"big.{i}.weight": torch.randn(BIG_SHAPE, generator=gen).to(torch.bfloat16)
        for i in range(BIG_TENSORS)
    }


def _passthrough(name: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
    return {name: t}


def _sender(port_queue, out) -> None:
    torch.cuda.set_device(0)
    store = open_store(TIMEOUT_S)
    port_queue.put(store.port)
    channel = TorchDistChannel(store, rank=SENDER_RANK, timeout_s=TIMEOUT_S, device=torch.device("cuda", 0))
    weights = {n: t.cuda() for n, t in weights_for(21).items()}
    # What this rank serializes, on its GPU: the CPU's fp32 arithmetic may round some codes differently
    serialized = {n: t for name, w in weights.items() for n, t in fp8_like_serialize(name, w).items()}
    out.put(("expected", {n: (str(t.dtype), tuple(t.shape), sha256(t.cpu())) for n, t in serialized.items()}))
    stats = WeightSender(channel, serialize=fp8_like_serialize, bucket_bytes=300).sync(weights.items(), 1)
    big = {n: t.cuda() for n, t in _big(5).items()}
    for version, verify in ((2, True), (3, False)):
        torch.cuda.synchronize()
        big_stats = WeightSender(channel, serialize=_passthrough, bucket_bytes=64 << 20).sync(
            big.items(), version
        )
        out.put(("sender", version, stats.num_buckets, big_stats.bytes, big_stats.total_s, verify))


def _receiver(port, out) -> None:
    torch.cuda.set_device(1)
    store = connect_store(port, TIMEOUT_S)
    channel = TorchDistChannel(store, rank=RECEIVER_RANK, timeout_s=TIMEOUT_S, device=torch.device("cuda", 1))
    engine = DictEngine()
    WeightReceiver(channel, expected_units(weights_for(21)), verify_checksum=True).receive(
        current_version=0, commit=engine.commit
    )
    got = {n: (str(t.dtype), tuple(t.shape), sha256(t.cpu())) for n, t in engine.wire.items()}
    devices = sorted({str(t.device) for t in engine.wire.values()})
    out.put(("receiver", got, devices))
    big_expected = [
        ExpectedUnit(source=n, tensors={n: (tuple(t.shape), t.dtype)}) for n, t in _big(5).items()
    ]
    for version, verify in ((2, True), (3, False)):
        big_engine = DictEngine()
        big_engine.version = version - 1
        start = time.perf_counter()
        WeightReceiver(channel, big_expected, verify_checksum=verify).receive(
            current_version=version - 1, commit=big_engine.commit
        )
        elapsed = time.perf_counter() - start
        ok = all(sha256(big_engine.wire[n].cpu()) == sha256(t) for n, t in _big(5).items())
        out.put(("receiver-big", version, ok, elapsed))


def main() -> dict:
    """Run both ranks; returns what each reported (raises if a rank fails or the bytes differ)."""
    ctx = mp.get_context("spawn")
    port_queue, out = ctx.Queue(), ctx.Queue()
    sender = ctx.Process(target=_sender, args=(port_queue, out))
    sender.start()
    receiver = ctx.Process(target=_receiver, args=(port_queue.get(timeout=TIMEOUT_S), out))
    receiver.start()
    for p in (sender, receiver):
        p.join(timeout=300)
    if sender.exitcode != 0 or receiver.exitcode != 0:
        raise RuntimeError(
            f"NCCL check failed: sender exit {sender.exitcode}, receiver exit {receiver.exitcode}"
        )
    results: dict = {}
    while not out.empty():
        item = out.get()
        results.setdefault(item[0], []).append(item[1:])
    got, expected = results["receiver"][0][0], results["expected"][0][0]
    differ = sorted(n for n in got.keys() | expected.keys() if got.get(n) != expected.get(n))
    if differ:
        raise RuntimeError(f"bytes received over NCCL differ from what was serialized: {differ}")
    if not all(ok for _, ok, _ in results["receiver-big"]):
        raise RuntimeError("the large bf16 payload arrived corrupted")
    return results


if __name__ == "__main__":
    report = main()
    print(torch.cuda.get_device_name(0), torch.__version__)
    print(f"{len(report['expected'][0][0])} small wire fixtures bit-identical on", report["receiver"][0][1])
    for (version, _, nbytes, total_s, verify), (_, _, recv_s) in zip(
        report["sender"], report["receiver-big"]
    ):
        print(
            f"v{version}: {nbytes / 2**20:.0f} MiB bf16 in 64 MiB buckets, checksum {'on' if verify else 'off'}: "
            f"sender {total_s:.3f} s ({nbytes / total_s / 1e9:.2f} GB/s), receiver {recv_s:.3f} s"
        )
