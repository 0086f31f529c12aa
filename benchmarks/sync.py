"""M2: weight-sync time per format / bf16, end to end through skyq.sync on one GPU.

The model is Qwen3-30B-A3B-shaped (hidden 2048, 32 q / 4 kv heads of 128, 128 experts of 768,
per layer 3 x 128 expert linears + attention + router + norms) with `--layers` layers and a small
vocabulary (2048, so a few-layer stack is not dominated by embeddings that no format quantizes).
The whole pipeline runs as a trainer would: the trainer's bf16 weights on the GPU (experts held
stacked per projection and handed to the sender as one (names, stack) item per projection, which
the strategy quantizes with one batched Triton call; fp8 quantizes every matrix and stack of a sync in
one grouped launch), `WeightSender` (value checks of what it packed, bucket packing
with one cat per bucket, device-side wsum64 checksums), the in-process transport (frames stay on
the GPU; since c6f00e4 the sender hands its buckets over, `InProcessChannel.give_frame`, where the
runs before it made a device clone per bucket), and `WeightReceiver` (checksum verification, unpacking to
views, value checks, accounting) whose commit copies every wire tensor into preallocated engine
buffers with `WireCopier` (integer words; destination views built once per layout). The engine
holds each projection's experts stacked, one [E, ...] buffer per wire position (`engine_buffers`),
as serving engines do (vLLM's fused-MoE weights), so a run of experts installs with one copy; the
runs before 2026-11-29 gave every wire tensor its own buffer. Checksums and value
checks are one pass per bucket on each side (`skyq.sync.scan`). Bucket size and checksum
verification are the `WeightSyncConfig` defaults.

Per format: one warm-up sync (Triton compiles); `--repeats` *first* syncs, each by a fresh sender
and receiver (full manifest, accounting against the plan); then `--repeats` *steady-state* syncs by
the last pair, which keeps the layout (a same-layout message, cached bucket plan). The M2 ratio is
the steady-state one (trainer and engine keep their pair for the run); the first-sync ratio is
printed too. The table is printed last.

    python benchmarks/sync.py [--layers 1] [--repeats 3]              # on the GPU
    python benchmarks/sync.py --device cpu --hidden 512 --expert-width 32  # tensor-count overhead on CPU

Cost: about a minute on the H200 for 2 layers and 5 repeats (results in docs/benchmarks.md, M2).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import threading
import time
from collections import Counter

import torch

from skyq.config.enums import Precision
from skyq.config.schema import ModelConfig, PrecisionConfig, WeightSyncConfig
from skyq.quant.kernels import dispatch
from skyq.quant.kernels.dispatch import deferred_finite_checks
from skyq.quant.plan import build_plan
from skyq.quant.strategies import get_strategy
from skyq.sync.in_process import in_process_pair
from skyq.sync.plan_wire import expected_units, plan_serializer
from skyq.sync.receiver import WeightReceiver
from skyq.sync.sender import WeightSender, serialize_stack_item, serialize_unit
from skyq.sync.wire_state import WireCopier


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


FORMATS = ["bf16", "fp8_blockwise", "mxfp8", "int4_qat"]
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def model_config(layers: int, hidden: int = 2048, expert_width: int = 768) -> ModelConfig:
    return ModelConfig(
        name="qwen3_30b_a3b_shaped", hidden_size=hidden, num_layers=layers, num_attention_heads=hidden // 64,
        num_key_value_heads=4, head_dim=128, moe_intermediate_size=expert_width, intermediate_size=3 * hidden,
        num_experts=128, num_experts_per_tok=8, vocab_size=2048,
    )  # fmt: skip


class Trainer:
    """bf16 weights on the GPU; experts stacked [E, N, K] per (layer, projection) as trainers hold them."""

    def __init__(self, plan, gen: torch.Generator, device: torch.device) -> None:
        self.device = device
        self.names = [p.name for p in plan]
        members: dict[tuple[str, str], list[str]] = {}
        for name in self.names:
            key = self._expert_key(name)
            if key is not None:
                members.setdefault(key, []).append(name)
        self.stack_names = {key: tuple(sorted(ns, key=self._expert_index)) for key, ns in members.items()}
        for names in self.stack_names.values():
            assert [self._expert_index(n) for n in names] == list(range(len(names)))
        self.stacks: dict[tuple[str, str], torch.Tensor] = {}
        self.dense: dict[str, torch.Tensor] = {}
        self.order: list[str | tuple[str, str]] = []  # dense names and stack keys, where each first appears
        for p in plan:
            key = self._expert_key(p.name)
            if key is None:
                self.dense[p.name] = self._random(p.shape, gen)
                self.order.append(p.name)
            elif key not in self.stacks:
                self.stacks[key] = self._random((len(self.stack_names[key]), *p.shape), gen)
                self.order.append(key)

    def flip(self) -> None:
        """Change every weight's sign (exact, same distribution): the next sync has new bytes."""
        for t in (*self.stacks.values(), *self.dense.values()):
            t.neg_()

    def _random(self, shape, gen) -> torch.Tensor:
        return (
            (torch.randn(shape, generator=gen, dtype=torch.float32, device=gen.device) * 0.02)
            .to(torch.bfloat16)
            .to(self.device)
        )

    @staticmethod
    def _expert_key(name: str) -> tuple[str, str] | None:
        if ".mlp.experts." not in name:
            return None
        prefix, rest = name.split(".mlp.experts.")
        return prefix, rest.split(".", 1)[1]

    def weights(self, stacked: bool = True):
        """(name, tensor) per dense tensor; each expert stack once, as (names, stack) when `stacked`
        (the sender then quantizes it with one call), else as per-expert (name, view) items."""
        for item in self.order:
            if isinstance(item, str):
                yield item, self.dense[item]
            elif stacked:
                yield self.stack_names[item], self.stacks[item]
            else:
                yield from zip(self.stack_names[item], self.stacks[item].unbind(0))

    @staticmethod
    def _expert_index(name: str) -> int:
        return int(name.split(".mlp.experts.")[1].split(".")[0])


class Pair:
    """A trainer's `WeightSender` and an engine's `WeightReceiver` on one in-process channel, kept
    across syncs as the launch actors keep theirs; the engine commits into preallocated buffers."""

    def __init__(self, plan, strategy, engine: dict[str, torch.Tensor], device: torch.device) -> None:
        cfg = WeightSyncConfig()
        send_end, recv_end = in_process_pair(cfg.timeout_s)
        self.sender = WeightSender(
            send_end, serialize=plan_serializer(strategy, plan), bucket_bytes=cfg.bucket_bytes
        )
        self.receiver = WeightReceiver(recv_end, expected_units(plan), verify_checksum=cfg.verify_checksum)
        self.engine = engine
        self.copier = WireCopier(engine)
        self.device = device
        self.version = 0

    def commit(self, wire: dict[str, torch.Tensor], version: int) -> None:
        # `WireCopier`: one multi-tensor copy per integer word size (each tensor's bytes as int64
        # words where it can), destination views built once per layout: no per-tensor view or check.
        assert len(wire) == len(self.engine), (len(wire), len(self.engine))
        self.copier.copy(wire)
        synchronize(self.device)
        self.version = version

    def sync(self, weights, version: int):
        errors: list[BaseException] = []

        def receive() -> None:
            try:
                self.receiver.receive(current_version=self.version, commit=self.commit)
            except BaseException as exc:  # re-raised in the main thread
                errors.append(exc)

        synchronize(self.device)
        thread = threading.Thread(target=receive)
        thread.start()
        stats = self.sender.sync(weights, version)
        thread.join()
        if errors:
            raise errors[0]
        return stats


def run_format(
    fmt: str, model_cfg: ModelConfig, gen: torch.Generator, repeats: int, device: torch.device
) -> dict:
    """Two warm-up syncs of one pair (a full one and a steady one, filled in place: each path's
    Triton compiles), `repeats` first syncs (a fresh sender and receiver each: full manifest), then
    `repeats` steady-state syncs of the last pair (same layout, buckets filled in place). The
    trainer's weights change sign before every sync, so each one moves new bytes."""
    precision = PrecisionConfig(name=Precision(fmt))
    plan = build_plan(model_cfg, precision)
    strategy = get_strategy(precision)
    trainer = Trainer(plan, gen, device)
    engine = engine_buffers(plan, device)
    first, steady = [], []
    pair = Pair(plan, strategy, engine, device)
    for version in (1, 2):  # warm-up
        trainer.flip()
        st = pair.sync(trainer.weights(), version)
        assert st.full_manifest == (version == 1) and st.in_place == (version == 2), (version, st)
    for version in range(3, 2 * repeats + 3):
        if version <= repeats + 2:
            pair = Pair(plan, strategy, engine, device)
            pair.version = version - 1
        trainer.flip()
        st = pair.sync(trainer.weights(), version)
        fresh = version <= repeats + 2
        assert st.full_manifest == fresh and st.in_place == (not fresh), (version, st)
        (first if fresh else steady).append(st)
    check_engine(trainer, strategy, plan, engine)
    med = {
        k: statistics.median(getattr(s, k) for s in steady)
        for k in ("gather_s", "quantize_s", "transfer_s", "load_s")
    }
    totals = [s.total_s for s in steady]
    return {"first": statistics.median(s.total_s for s in first), "total": statistics.median(totals),
            "min": min(totals), "max": max(totals), "bytes": steady[0].bytes, "tensors": steady[0].num_tensors,
            "buckets": steady[0].num_buckets, **med}  # fmt: skip


def engine_buffers(plan, device: torch.device) -> dict[str, torch.Tensor]:
    """The engine's buffers: wire name -> tensor of the plan's shape and dtype; the experts of one
    (layer, projection, wire tensor) are rows of one stacked [E, ...] buffer, in expert order."""
    groups: dict[tuple[str, str], list[tuple[int, object]]] = {}
    engine: dict[str, torch.Tensor] = {}
    for p in plan:
        for w in p.wire:
            if ".mlp.experts." in w.name:
                prefix, rest = w.name.split(".mlp.experts.")
                index, tail = rest.split(".", 1)
                groups.setdefault((prefix, tail), []).append((int(index), w))
            else:
                engine[w.name] = torch.empty(w.shape, dtype=w.dtype, device=device)
    for members in groups.values():
        members.sort(key=lambda m: m[0])
        first = members[0][1]
        stacked = torch.empty((len(members), *first.shape), dtype=first.dtype, device=device)
        for row, (_, w) in zip(stacked, members):
            engine[w.name] = row
    return engine


def check_engine(trainer: Trainer, strategy, plan, engine: dict[str, torch.Tensor]) -> None:
    """The engine holds exactly what the strategy makes of the trainer's current weights: every
    dense tensor, and the first and last expert of each stack."""
    names = set(trainer.dense)
    for members in trainer.stack_names.values():
        names.update((members[0], members[-1]))
    for name, w in trainer.weights(stacked=False):
        if name not in names:
            continue
        for wname, t in strategy.serialize(name, w, role=plan[name].role).items():
            got = engine[wname].cpu().view(torch.uint8)
            assert torch.equal(got, t.cpu().contiguous().view(torch.uint8)), wname


def finite_check_cost(gen: torch.Generator, n: int = 384) -> tuple[float, float]:
    """Quantizing n expert-shaped tensors (768 x 2048) with fp8: per-call sync vs one deferred sync."""
    ws = [
        (torch.randn(768, 2048, generator=gen, device=gen.device) * 0.02).to(torch.bfloat16).cuda()
        for _ in range(n)
    ]
    for w in ws[:4]:
        dispatch.quantize_fp8_blockwise(w)

    def per_call() -> None:
        for w in ws:
            dispatch.quantize_fp8_blockwise(w)

    def deferred() -> None:
        with dispatch.deferred_finite_checks():
            for w in ws:
                dispatch.quantize_fp8_blockwise(w)

    out = []
    for fn in (per_call, deferred):
        times = []
        for _ in range(5):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        out.append(statistics.median(times))
    return out[0], out[1]


HOST_WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "aten::item",
              "aten::_local_scalar_dense", "cudaMemcpyAsync", "cudaLaunchKernel")  # fmt: skip


def profile_steady(fmt: str, model_cfg: ModelConfig, gen: torch.Generator, device: torch.device) -> dict:
    """One steady-state sync of `fmt` (after a warm-up and a first sync of the same pair) under
    torch.profiler (CPU, and CUDA on a GPU) and a Python call counter over every thread. Prints the
    top ops by self CPU time and returns the wall time, host-wait counts and Python calls."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    precision = PrecisionConfig(name=Precision(fmt))
    plan = build_plan(model_cfg, precision)
    strategy = get_strategy(precision)
    trainer = Trainer(plan, gen, device)
    engine = engine_buffers(plan, device)
    pair = Pair(plan, strategy, engine, device)
    for version in (1, 2, 3):
        trainer.flip()
        pair.sync(trainer.weights(), version)
    calls = Counter()

    def count(frame, event, arg) -> None:
        if event == "call":
            calls[threading.current_thread().name == "MainThread"] += 1

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    trainer.flip()
    synchronize(device)
    with profile(activities=activities) as prof:
        threading.setprofile(count)
        sys.setprofile(count)
        start = time.perf_counter()
        st = pair.sync(trainer.weights(), 4)
        wall = time.perf_counter() - start
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
    assert not st.full_manifest
    events = prof.key_averages()
    waits = {name: 0 for name in HOST_WAITS}
    for e in events:
        if e.key in waits:
            waits[e.key] += e.count
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    print(f"\n--- profile: one steady {fmt} sync, {wall * 1e3:.1f} ms wall, {st.num_tensors} wire tensors, "
          f"{st.num_buckets} buckets; quantize {st.quantize_s * 1e3:.1f} transfer {st.transfer_s * 1e3:.1f} "
          f"load {st.load_s * 1e3:.1f} ms")  # fmt: skip
    print(events.table(sort_by="self_cpu_time_total", row_limit=15))
    if device.type == "cuda":
        print(events.table(sort_by=sort, row_limit=10))
    aten = sum(e.count for e in events if e.key.startswith("aten::"))
    cuda_s = sum(e.self_device_time_total for e in events if e.device_type != DeviceType.CPU) / 1e6
    print("host waits: " + ", ".join(f"{k} {v}" for k, v in waits.items()))
    print(f"aten op calls {aten}, self CPU {sum(e.self_cpu_time_total for e in events) / 1e3:.1f} ms, "
          f"device time {cuda_s * 1e3:.1f} ms")  # fmt: skip
    print(f"python calls: main (sender) {calls[True]}, receiver thread {calls[False]}")
    quantize_items(trainer, pair.sender, device)
    prof = cProfile.Profile()
    trainer.flip()
    synchronize(device)
    prof.enable()
    pair.sync(trainer.weights(), 5)
    prof.disable()
    print("sender thread, cProfile of one more steady sync, top functions by own time:")
    pstats.Stats(prof).sort_stats("tottime").print_stats(12)
    return {"wall": wall, "waits": waits, "calls": calls[True] + calls[False], "aten_ops": aten}


def quantize_items(trainer: Trainer, sender: WeightSender, device: torch.device) -> None:
    """The sender's quantize stage item by item: host time of each serialize call, and the time
    until the device finished it; prints the five slowest by host time and the totals."""
    serialize = sender._serialize
    rows = []
    synchronize(device)
    with deferred_finite_checks():
        for name, tensor in trainer.weights():
            start = time.perf_counter()
            if isinstance(name, str):
                serialize_unit(name, tensor, serialize, 0, check=False)
            else:
                serialize_stack_item(tuple(name), tensor, serialize, 0, check=False)
            host = time.perf_counter() - start
            synchronize(device)
            label = name if isinstance(name, str) else f"{name[0]} (+{len(name) - 1})"
            rows.append((host, time.perf_counter() - start, label))
    print(f"quantize stage, {len(rows)} items: host {sum(r[0] for r in rows) * 1e3:.2f} ms, "
          f"host + device {sum(r[1] for r in rows) * 1e3:.2f} ms; slowest by host time:")  # fmt: skip
    for host, done, label in sorted(rows, reverse=True)[:5]:
        print(f"  {host * 1e3:7.3f} ms host {done * 1e3:7.3f} ms done  {label}")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3, help="first syncs and steady-state syncs, each")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--hidden", type=int, default=2048, help="smaller on CPU: fewer bytes, as many tensors")
    ap.add_argument("--expert-width", type=int, default=768)
    ap.add_argument(
        "--profile",
        action="store_true",
        help="instead of the table: profile one steady sync per --profile-formats (host waits, calls)",
    )
    ap.add_argument("--profile-formats", nargs="+", default=["bf16", "fp8_blockwise"], choices=FORMATS)
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    device = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    print(f"device {device}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}, layers {args.layers}")
    # on the GPU the weights are drawn there (a CPU draw of a 4-layer stack takes minutes of the call)
    gen = torch.Generator(device=dev).manual_seed(0)
    model_cfg = model_config(args.layers, args.hidden, args.expert_width)
    if args.profile:
        return {fmt: profile_steady(fmt, model_cfg, gen, dev) for fmt in args.profile_formats}
    if dev.type == "cuda":
        pc, dc = finite_check_cost(gen)
        print(
            f"fp8 quantize of 384 expert tensors: per-call checks {pc * 1e3:.1f} ms, deferred {dc * 1e3:.1f} ms"
        )
    print(
        "\nsteady state (same layout); first = a fresh sender/receiver pair (full manifest), medians\n"
        "format         first s   steady s [min-max]        GB    tensors buckets  gather  quantize  transfer  load"
    )
    results = {}
    for fmt in FORMATS:  # each row as it completes, so a time limit leaves the finished ones
        results[fmt] = r = run_format(fmt, model_cfg, gen, args.repeats, dev)
        print(f"{fmt:<14} {r['first']:7.3f}   {r['total']:7.3f} [{r['min']:.3f}-{r['max']:.3f}]  {r['bytes'] / 1e9:6.3f}  "
              f"{r['tensors']:>7} {r['buckets']:>6}  {r['gather_s']:6.3f}  {r['quantize_s']:8.3f}  "
              f"{r['transfer_s']:8.3f}  {r['load_s']:5.3f}")  # fmt: skip
    print("\nmetric                              ours s   baseline (bf16) s  ratio  device")
    for kind, key in (("steady", "total"), ("first", "first")):
        base = results["bf16"][key]
        for fmt in FORMATS[1:]:
            r = results[fmt][key]
            print(f"M2 sync time {kind:<6} {fmt:<14} {r:8.3f}   {base:16.3f}  {r / base:5.2f}  {device}")
    return results


if __name__ == "__main__":
    main()
