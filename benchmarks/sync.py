"""M2: weight-sync time per format / bf16, end to end through skyq.sync on one GPU.

The model is Qwen3-30B-A3B-shaped (hidden 2048, 32 q / 4 kv heads of 128, 128 experts of 768,
per layer 3 x 128 expert linears + attention + router + norms) with `--layers` layers and a small
vocabulary (2048, so a few-layer stack is not dominated by embeddings that no format quantizes).
The whole pipeline runs as a trainer would: the trainer's bf16 weights on the GPU (experts held
stacked per projection and handed to the sender as one (names, stack) item per projection, which
the strategy quantizes with one batched Triton call), `WeightSender` (finite checks, bucket packing
with one cat per bucket, device-side wsum64 checksums), the in-process
transport (frames stay on the GPU: a device clone per bucket), and `WeightReceiver` (checksum
verification, unpacking to views, value checks, accounting) whose commit copies every wire tensor
into preallocated engine buffers on the GPU (one `torch._foreach_copy_`). Bucket size and checksum verification are the
`WeightSyncConfig` defaults. Each format: one warm-up sync (Triton compiles), then `--repeats`.

    python benchmarks/sync.py [--layers 1] [--repeats 2]

Cost: about 35-40 s on the H200 for 1 layer and 4 repeats (results in docs/benchmarks.md, M2).
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import torch

from skyq.config.enums import Precision
from skyq.config.schema import ModelConfig, PrecisionConfig, WeightSyncConfig
from skyq.quant.kernels import dispatch
from skyq.quant.plan import build_plan
from skyq.quant.strategies import get_strategy
from skyq.sync.in_process import in_process_pair
from skyq.sync.plan_wire import expected_units, plan_serializer
from skyq.sync.receiver import WeightReceiver
from skyq.sync.sender import WeightSender

FORMATS = ["bf16", "fp8_blockwise", "mxfp8", "int4_qat"]
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def model_config(layers: int) -> ModelConfig:
    return ModelConfig(
        name="qwen3_30b_a3b_shaped", hidden_size=2048, num_layers=layers, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, moe_intermediate_size=768, intermediate_size=6144,
        num_experts=128, num_experts_per_tok=8, vocab_size=2048,
    )  # fmt: skip


class Trainer:
    """bf16 weights on the GPU; experts stacked [E, N, K] per (layer, projection) as trainers hold them."""

    def __init__(self, plan, gen: torch.Generator) -> None:
        self.names = [p.name for p in plan]
        self.stacks: dict[tuple[str, str], torch.Tensor] = {}
        self.dense: dict[str, torch.Tensor] = {}
        for p in plan:
            key = self._expert_key(p.name)
            if key is None:
                self.dense[p.name] = self._random(p.shape, gen)
            elif key not in self.stacks:
                n_exp = sum(1 for q in plan if self._expert_key(q.name) == key)
                self.stacks[key] = self._random((n_exp, *p.shape), gen)

    @staticmethod
    def _random(shape, gen) -> torch.Tensor:
        return (torch.randn(shape, generator=gen, dtype=torch.float32) * 0.02).to(torch.bfloat16).cuda()

    @staticmethod
    def _expert_key(name: str) -> tuple[str, str] | None:
        if ".mlp.experts." not in name:
            return None
        prefix, rest = name.split(".mlp.experts.")
        return prefix, rest.split(".", 1)[1]

    def weights(self, stacked: bool = True):
        """(name, tensor) per dense tensor; each expert stack once, as (names, stack) when `stacked`
        (the sender then quantizes it with one call), else as per-expert (name, view) items."""
        members: dict[tuple[str, str], list[str]] = {}
        for name in self.names:
            key = self._expert_key(name)
            if key is not None:
                members.setdefault(key, []).append(name)
        for name in self.names:
            key = self._expert_key(name)
            if key is None:
                yield name, self.dense[name]
            elif not stacked:
                yield name, self.stacks[key][self._expert_index(name)]
            elif members[key][0] == name:
                names = sorted(members[key], key=self._expert_index)
                assert [self._expert_index(n) for n in names] == list(range(len(names)))
                yield tuple(names), self.stacks[key]

    @staticmethod
    def _expert_index(name: str) -> int:
        return int(name.split(".mlp.experts.")[1].split(".")[0])


def run_format(fmt: str, model_cfg: ModelConfig, gen: torch.Generator, repeats: int) -> dict:
    sync_cfg = WeightSyncConfig()
    precision = PrecisionConfig(name=Precision(fmt))
    plan = build_plan(model_cfg, precision)
    strategy = get_strategy(precision)
    trainer = Trainer(plan, gen)
    engine = {w.name: torch.empty(w.shape, dtype=w.dtype, device="cuda") for p in plan for w in p.wire}

    def commit(wire: dict[str, torch.Tensor], version: int) -> None:
        # One fused multi-tensor copy of the bytes (every wire tensor is contiguous; uint8 views
        # put fp8, fp32, bf16 and int tensors in one list).
        torch._foreach_copy_(
            [engine[name].view(torch.uint8) for name in wire], [t.view(torch.uint8) for t in wire.values()]
        )
        torch.cuda.synchronize()

    stats = []
    for version in range(1, repeats + 2):
        send_end, recv_end = in_process_pair(sync_cfg.timeout_s)
        sender = WeightSender(
            send_end, serialize=plan_serializer(strategy, plan), bucket_bytes=sync_cfg.bucket_bytes
        )
        receiver = WeightReceiver(recv_end, expected_units(plan), verify_checksum=sync_cfg.verify_checksum)
        errors: list[BaseException] = []

        def receive(receiver=receiver, version=version, errors=errors) -> None:
            try:
                receiver.receive(current_version=version - 1, commit=commit)
            except BaseException as exc:  # re-raised in the main thread
                errors.append(exc)

        torch.cuda.synchronize()
        thread = threading.Thread(target=receive)
        thread.start()
        st = sender.sync(trainer.weights(), version)
        thread.join()
        if errors:
            raise errors[0]
        if version > 1:
            stats.append(st)
    # the engine holds exactly what the strategy makes of the trainer's weights
    name, w = next((n, t) for n, t in trainer.weights(stacked=False) if "experts.1.up_proj" in n)
    for wname, t in strategy.serialize(name, w, role=plan[name].role).items():
        assert torch.equal(engine[wname].cpu().view(torch.uint8), t.cpu().contiguous().view(torch.uint8)), (
            wname
        )
    med = {
        k: statistics.median(getattr(s, k) for s in stats)
        for k in ("gather_s", "quantize_s", "transfer_s", "load_s")
    }
    totals = [s.total_s for s in stats]
    return {"total": statistics.median(totals), "min": min(totals), "max": max(totals), "bytes": stats[0].bytes,
            "tensors": stats[0].num_tensors, "buckets": stats[0].num_buckets, **med}  # fmt: skip


def finite_check_cost(gen: torch.Generator, n: int = 384) -> tuple[float, float]:
    """Quantizing n expert-shaped tensors (768 x 2048) with fp8: per-call sync vs one deferred sync."""
    ws = [(torch.randn(768, 2048, generator=gen) * 0.02).to(torch.bfloat16).cuda() for _ in range(n)]
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    device = torch.cuda.get_device_name()
    print(f"device {device}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}, layers {args.layers}")
    gen = torch.Generator().manual_seed(0)
    pc, dc = finite_check_cost(gen)
    print(
        f"fp8 quantize of 384 expert tensors: per-call checks {pc * 1e3:.1f} ms, deferred {dc * 1e3:.1f} ms"
    )
    model_cfg = model_config(args.layers)
    print(
        "\nformat          total s [min-max]        GB    tensors buckets  gather  quantize  transfer  load"
    )
    results = {}
    for fmt in FORMATS:  # each row as it completes, so a time limit leaves the finished ones
        results[fmt] = r = run_format(fmt, model_cfg, gen, args.repeats)
        print(f"{fmt:<14} {r['total']:7.3f} [{r['min']:.3f}-{r['max']:.3f}]  {r['bytes'] / 1e9:6.3f}  {r['tensors']:>7} "
              f"{r['buckets']:>6}  {r['gather_s']:6.3f}  {r['quantize_s']:8.3f}  {r['transfer_s']:8.3f}  {r['load_s']:5.3f}")  # fmt: skip
    base = results["bf16"]["total"]
    print("\nmetric                         ours s   baseline (bf16) s  ratio  device")
    for fmt in FORMATS[1:]:
        r = results[fmt]["total"]
        print(f"M2 sync time {fmt:<16} {r:8.3f}   {base:16.3f}  {r / base:5.2f}  {device}")


if __name__ == "__main__":
    main()
