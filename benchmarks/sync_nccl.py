"""M2 across two GPUs: weight sync from a trainer process on cuda:0 to an engine process on cuda:1 over NCCL.

Two processes, each with one device, joined by skyq's own `TorchDistChannel` (a private two-rank
ProcessGroupNCCL on a loopback TCPStore; NVLink multicast off: NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1 are set here before anything starts).
The model is the Qwen3-30B-A3B-shaped stack of `benchmarks/sync.py` (`--layers` layers, 128 experts
of 768, experts held stacked per projection as a trainer holds them). Per format, rank 0 runs
`WeightSender` (finite checks, the strategy's batched quantization, bucket packing, wsum64
checksums) and rank 1 `WeightReceiver` (checksum verification, unpacking, accounting) committing
into preallocated engine buffers with `WireCopier`, exactly as the Ray actors of a two-GPU run do.

Per format: one first sync (full manifest, Triton compiles) and one steady-state warm-up sync (the
buckets filled in place: that path's compiles), then `--repeats` steady-state syncs by the same
pair (same layout), the trainer's weights changing sign before each. After the last sync
both ranks digest every wire tensor (sha256 of the bytes): the engine's buffers against what the
strategy makes of the trainer's current weights, tensor by tensor (the per-tensor serialize, not the
batched call the sender used). The baseline is a plain NCCL broadcast of the same bytes in
buckets of the same size on the same group, ended by a one-element acknowledgement so both ranks'
clocks cover the delivery. The table is printed last.

    python benchmarks/sync_nccl.py [--layers 2] [--repeats 5]            # two GPUs
    python benchmarks/sync_nccl.py --device cpu --hidden 256 --expert-width 32 --layers 1 --repeats 1
                                                                           # gloo, two CPU processes

Cost: about a minute on two H200s for 2 layers (results in docs/benchmarks.md, "two-GPU sync").
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time

for _key in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
    os.environ.setdefault(_key, "0" if _key == "NCCL_NVLS_ENABLE" else "1")

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402


def _sibling(name: str):
    """benchmarks/<name>.py by path (a plain `import sync` can find another module of that name)."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"skyq_benchmarks_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


_sync_bench = _sibling("sync")
FORMATS, Trainer, model_config = _sync_bench.FORMATS, _sync_bench.Trainer, _sync_bench.model_config
engine_buffers = _sync_bench.engine_buffers

from skyq.config.enums import Precision  # noqa: E402
from skyq.config.schema import PrecisionConfig, WeightSyncConfig  # noqa: E402
from skyq.quant.plan import build_plan  # noqa: E402
from skyq.quant.strategies import get_strategy  # noqa: E402
from skyq.sync.plan_wire import expected_units, plan_serializer, wire_digest  # noqa: E402
from skyq.sync.receiver import WeightReceiver  # noqa: E402
from skyq.sync.sender import WeightSender  # noqa: E402
from skyq.sync.torch_dist import RECEIVER_RANK, SENDER_RANK, TorchDistChannel, connect_store, open_store  # noqa: E402
from skyq.sync.wire_state import WireCopier  # noqa: E402

TIMEOUT_S = 300.0
PHASES = ("gather_s", "quantize_s", "transfer_s", "load_s")


def _device(kind: str, rank: int) -> torch.device:
    if kind == "cuda":
        torch.cuda.set_device(rank)
        return torch.device("cuda", rank)
    return torch.device("cpu")


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _plan(fmt: str, args):
    precision = PrecisionConfig(name=Precision(fmt))
    plan = build_plan(model_config(args.layers, args.hidden, args.expert_width), precision)
    return plan, get_strategy(precision)


def plain_broadcast(channel: TorchDistChannel, nbytes: int, bucket: int, device, repeats: int) -> float:
    """Median seconds to broadcast rank 0's `nbytes` (rank 1 passes anything: it learns the number
    first) in `bucket`-byte pieces, enqueued without host waits, each timing ended by rank 1's
    one-element acknowledgement (which both hosts wait for)."""
    size = torch.tensor([nbytes], dtype=torch.int64, device=device)
    channel.broadcast(size, SENDER_RANK)
    nbytes = int(size.item())
    buf = torch.zeros(min(bucket, nbytes), dtype=torch.uint8, device=device)
    ack = torch.zeros(1, dtype=torch.int64, device=device)
    times = []
    for _ in range(repeats + 1):  # the first one warms the group's buffers
        _synchronize(device)
        start = time.perf_counter()
        left = nbytes
        while left > 0:
            n = min(bucket, left)
            channel.broadcast(buf[:n], SENDER_RANK, host_waits=False)
            left -= n
        channel.broadcast(ack, RECEIVER_RANK)
        _synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def _sender(args, port_queue, out) -> None:
    device = _device(args.device, 0)
    store = open_store(TIMEOUT_S)
    port_queue.put(store.port)
    channel = TorchDistChannel(store, rank=SENDER_RANK, timeout_s=TIMEOUT_S, device=device)
    cfg = WeightSyncConfig()
    gen = torch.Generator().manual_seed(0)
    for fmt in args.formats:
        plan, strategy = _plan(fmt, args)
        trainer = Trainer(plan, gen, device)
        sender = WeightSender(
            channel, serialize=plan_serializer(strategy, plan), bucket_bytes=cfg.bucket_bytes
        )
        stats = []
        for version in range(1, args.repeats + 3):
            trainer.flip()
            _synchronize(device)
            stats.append(sender.sync(trainer.weights(), version))
        assert [s.in_place for s in stats] == [False] + [True] * (args.repeats + 1), stats
        expected = {}
        for name, w in trainer.weights(stacked=False):
            expected.update(wire_digest(strategy.serialize(name, w, role=plan[name].role)))
        steady = stats[2:]
        plain = plain_broadcast(channel, steady[0].bytes, cfg.bucket_bytes, device, args.repeats)
        out.put(("sender", fmt, {
            "first": stats[0].total_s, "total": statistics.median(s.total_s for s in steady),
            "min": min(s.total_s for s in steady), "max": max(s.total_s for s in steady),
            "bytes": steady[0].bytes, "tensors": steady[0].num_tensors, "buckets": steady[0].num_buckets,
            "full_manifest": [s.full_manifest for s in stats], "plain": plain, "digest": expected,
            **{k: statistics.median(getattr(s, k) for s in steady) for k in PHASES},
        }))  # fmt: skip
        del trainer, sender
        if device.type == "cuda":
            torch.cuda.empty_cache()
    channel.close()


def _receiver(args, port, out) -> None:
    device = _device(args.device, 1 if args.device == "cuda" else 0)
    channel = TorchDistChannel(
        connect_store(port, TIMEOUT_S), rank=RECEIVER_RANK, timeout_s=TIMEOUT_S, device=device
    )
    cfg = WeightSyncConfig()
    for fmt in args.formats:
        plan, _ = _plan(fmt, args)
        engine = engine_buffers(plan, device)
        copier = WireCopier(engine)
        receiver = WeightReceiver(channel, expected_units(plan), verify_checksum=cfg.verify_checksum)

        def commit(wire, version, copier=copier) -> None:
            copier.copy(wire)
            _synchronize(device)

        recv_s = []
        for version in range(1, args.repeats + 3):
            st = receiver.receive(current_version=version - 1, commit=commit)
            assert st.version == version, (st.version, version)
            recv_s.append(st.recv_s)
        out.put(("receiver", fmt, {
            "digest": wire_digest(engine), "devices": sorted({str(t.device) for t in engine.values()}),
            "recv_s": statistics.median(recv_s[2:]),
        }))  # fmt: skip
        plain_broadcast(channel, 0, cfg.bucket_bytes, device, args.repeats)
        del engine, copier, receiver
        if device.type == "cuda":
            torch.cuda.empty_cache()
    channel.close()


def run(args) -> dict[str, dict]:
    """Both ranks as spawned processes; returns {format: merged report} (raises if a rank fails)."""
    ctx = mp.get_context("spawn")
    port_queue, out = ctx.Queue(), ctx.Queue()
    sender = ctx.Process(target=_sender, args=(args, port_queue, out))
    sender.start()
    receiver = ctx.Process(target=_receiver, args=(args, port_queue.get(timeout=TIMEOUT_S), out))
    receiver.start()
    reports: dict[str, dict] = {}
    expected = 2 * len(args.formats)
    limit_s = TIMEOUT_S * (1 + len(args.formats))
    deadline = time.monotonic() + limit_s  # a wedged rank fails the run instead of hanging it
    while expected:  # drain while the ranks run: a full queue would block them
        try:
            side, fmt, report = out.get(timeout=5)
        except Exception:  # queue.Empty: check the ranks are alive and the run is on time
            if sender.exitcode not in (None, 0) or receiver.exitcode not in (None, 0):
                break
            if time.monotonic() > deadline:
                for p in (sender, receiver):
                    p.kill()
                raise RuntimeError(
                    f"sync benchmark: the ranks did not finish within {limit_s:.0f} s; killed"
                ) from None
            continue
        reports.setdefault(fmt, {})[side] = report
        expected -= 1
    for p in (sender, receiver):
        p.join(timeout=TIMEOUT_S)
    if sender.exitcode != 0 or receiver.exitcode != 0:
        raise RuntimeError(
            f"sync benchmark failed: sender exit {sender.exitcode}, receiver exit {receiver.exitcode}"
        )
    merged = {}
    for fmt in args.formats:
        s, r = reports[fmt]["sender"], reports[fmt]["receiver"]
        diff = sorted(
            n for n in s["digest"].keys() | r["digest"].keys() if s["digest"].get(n) != r["digest"].get(n)
        )
        merged[fmt] = {**s, "identical": not diff, "differing": diff[:5], "tensors_checked": len(s["digest"]),
                       "devices": r["devices"], "recv_s": r["recv_s"]}  # fmt: skip
        del merged[fmt]["digest"]
    return merged


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5, help="steady-state syncs per format")
    ap.add_argument(
        "--device", default="cuda", choices=("cuda", "cpu"), help="cpu: gloo between two processes"
    )
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--expert-width", type=int, default=768)
    ap.add_argument("--formats", nargs="+", default=FORMATS, choices=FORMATS)
    return ap.parse_args(argv)


def main(argv=None) -> dict[str, dict]:
    args = parse_args(argv)
    if args.device == "cuda" and torch.cuda.device_count() < 2:
        raise SystemExit(
            f"needs two CUDA devices, found {torch.cuda.device_count()} (or run with --device cpu)"
        )
    device = f"2x {torch.cuda.get_device_name(0)}, NCCL" if args.device == "cuda" else "2 CPU processes, gloo"
    print(f"{device}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}, layers {args.layers}, "
          f"steady repeats {args.repeats}")  # fmt: skip
    results = run(args)
    print("\nformat         first s  steady s [min-max]        GB  tensors buckets  gather  quantize  transfer"
          "   load   GB/s  plain s  plain GB/s  /plain  bit-identical")  # fmt: skip
    for fmt, r in results.items():
        gbs = r["bytes"] / r["total"] / 1e9
        print(f"{fmt:<14} {r['first']:7.3f}  {r['total']:7.3f} [{r['min']:.3f}-{r['max']:.3f}]  "
              f"{r['bytes'] / 1e9:6.3f}  {r['tensors']:>7} {r['buckets']:>6}  {r['gather_s']:6.3f}  "
              f"{r['quantize_s']:8.3f}  {r['transfer_s']:8.3f}  {r['load_s']:5.3f}  {gbs:5.1f}  "
              f"{r['plain']:7.3f}  {r['bytes'] / r['plain'] / 1e9:10.1f}  {r['total'] / r['plain']:6.2f}  "
              f"{r['identical']} ({r['tensors_checked']} tensors on {','.join(r['devices'])})")  # fmt: skip
    if "bf16" in results:
        print("\nmetric                                    ours s   baseline (bf16) s  ratio  device")
        base = results["bf16"]["total"]
        for fmt, r in results.items():
            if fmt != "bf16":
                print(f"M2 two-rank sync steady {fmt:<14} {r['total']:8.3f}   {base:16.3f}  "
                      f"{r['total'] / base:5.2f}  {device}")  # fmt: skip
    bad = [fmt for fmt, r in results.items() if not r["identical"]]
    if bad:
        raise SystemExit(f"engine weights differ from what was serialized for {bad}: "
                         f"{[results[f]['differing'] for f in bad]}")  # fmt: skip
    return results


if __name__ == "__main__":
    main()
