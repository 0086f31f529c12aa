"""M5: train/rollout mismatch per precision on the SAME sequences, against bf16, in one run.

For each precision a trainer and an embedded engine are built in this process from the same
starting checkpoint (`LocalPair`, weights synced through the in-process channel, the engine's copy
checked bit for bit). The sequences are sampled once, by the bf16 engine, from the task's prompts;
then every precision's trainer (`NativeTrainer.logprobs`) and engine (`EmbeddedEngine.score`,
teacher-forced at the engine's precision) score exactly those tokens. Mismatch = mean |logp_trainer -
logp_engine| over response tokens; the bar (M5) is <= 1.5x bf16's.

    python benchmarks/mismatch.py                          # tiny_moe on this machine's CPU
    python benchmarks/mismatch.py --model small_moe --device cuda --prompts 64
    python benchmarks/mismatch.py --flips                  # + per-projection activation code flips

`--flips` also captures, for the FP8 precisions, the input of every activation-quantized linear on
both sides during that scoring (the trainer's rounded to bf16, as its quantizer sees it) and prints
per projection how many e4m3 codes and tile scales differ between trainer and engine, and how far
apart the inputs were in bf16 ulps of the engine's value.

Needs hydra/omegaconf (the configs are composed); on a bare GPU box see docs/gpu_box.md.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch
from torch import Tensor, nn

from skyq.config.enums import Precision, ScaleFormat
from skyq.config.store import compose, to_object
from skyq.launch.local_pair import LocalPair
from skyq.launch.pair import PairSpec
from skyq.launch.placement import placement_for
from skyq.quant import fp8_blockwise, mxfp8
from skyq.rl.batch import RolloutBatch, collate
from skyq.rl.tasks import build_task
from skyq.rl.tokenizer import EOS_ID
from skyq.rollout.quantized_linear import WireExperts, WireLinear
from skyq.trainer.native.precision import (
    ActivationQuantExperts,
    ActivationQuantLinear,
    Fp8GemmExperts,
    Fp8GemmLinear,
)
from skyq.trainer.native.tiny_checkpoint import ensure_tiny_checkpoint

PRECISIONS = ("bf16", "fp8_blockwise", "mxfp8", "int4_qat")


def build_pair(overrides: list[str], device: str) -> tuple[LocalPair, object]:
    cfg = to_object(compose(overrides))
    checkpoint = ensure_tiny_checkpoint(
        cfg.model, cfg.task, cache_dir=cfg.checkpoint.cache_dir, device=device
    )
    spec = PairSpec(
        model=cfg.model, precision=cfg.precision, algorithm=cfg.algorithm, trainer=cfg.trainer,
        rollout=cfg.rollout, placement=placement_for(cfg.topology, cfg.rollout.weight_sync.transport),
        checkpoint_path=str(checkpoint), seed=cfg.seed, eos_token_id=EOS_ID,
    )  # fmt: skip
    return LocalPair(spec), cfg


def sample_sequences(pair: LocalPair, cfg, prompts: int, group: int) -> RolloutBatch:
    task = build_task(cfg.task, seed=cfg.seed)
    chosen = task.prompts(0, prompts)
    samples = pair.generate([p.token_ids for p in chosen], n=group, max_new_tokens=cfg.task.max_response_length,
                            temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p, seed=0)  # fmt: skip
    return collate(samples, [0.0] * len(samples), group_size=group, normalize_std=False,
                   pad_token_id=task.tokenizer.eos_token_id)  # fmt: skip


def mismatch(pair: LocalPair, cfg, seqs: RolloutBatch) -> tuple[float, float]:
    trainer = pair.trainer.trainer.logprobs(seqs.input_ids, seqs.attention_mask)
    engine = pair.engine.score(seqs.input_ids, seqs.attention_mask, cfg.rollout.temperature)
    mask = seqs.response_mask.bool()
    diff = (trainer[mask] - engine[mask]).abs()
    return float(diff.mean()), float(diff.max())


TRAINER_QUANTIZED = (ActivationQuantLinear, ActivationQuantExperts, Fp8GemmLinear, Fp8GemmExperts)


def _capture_inputs(model: nn.Module, is_quantized) -> tuple[dict[str, list[Tensor]], list]:
    """Pre-hooks recording the first input of every module `is_quantized(name, module)` selects
    (a routed-experts block: its hidden states, the input of every expert's gate/up projection)."""
    captured: dict[str, list[Tensor]] = defaultdict(list)
    hooks = [
        module.register_forward_pre_hook(
            lambda mod, args, name=name: captured[name].append(args[0].detach().to(torch.bfloat16))
        )
        for name, module in model.named_modules()
        if is_quantized(name, module)
    ]
    return captured, hooks


def _codes(x: Tensor, cfg) -> tuple[Tensor, Tensor]:
    """(dequantizable codes as floats, per-element tile scale) of activation rows x [M, K]."""
    if Precision(cfg.precision.name) is Precision.mxfp8:
        q, scale = mxfp8.quantize(x)
        return q.float(), scale.repeat_interleave(mxfp8.BLOCK, -1)[..., : x.shape[-1]]
    tile = cfg.precision.activation_tile
    pow2 = ScaleFormat(cfg.precision.scale_format) is ScaleFormat.ue8m0
    q, scale_inv = fp8_blockwise.quantize_activation(x, tile=tile, pow2_scale=pow2)
    return q.float(), scale_inv.repeat_interleave(tile, -1)[..., : x.shape[-1]]


def activation_flips(
    pair: LocalPair, cfg, seqs: RolloutBatch
) -> list[tuple[str, float, float, float, float]]:
    """Score `seqs` on both sides with the quantized linears' inputs captured; per projection
    (name, fraction of e4m3 codes that differ, of elements whose tile scale differs, of inputs
    that differ, median |input difference| in bf16 ulps of the engine's value), over real tokens."""
    trainer_model = pair.trainer.trainer.model
    engine_model = pair.engine.engine.model
    trained, trainer_hooks = _capture_inputs(trainer_model, lambda n, m: isinstance(m, TRAINER_QUANTIZED))
    served, engine_hooks = _capture_inputs(
        engine_model,
        lambda n, m: (
            isinstance(m, WireExperts)
            or (isinstance(m, WireLinear) and m.activation is not None and ".experts." not in n)
        ),
    )
    try:
        mismatch(pair, cfg, seqs)
    finally:
        for hook in trainer_hooks + engine_hooks:
            hook.remove()
    real = seqs.attention_mask.bool().reshape(-1)
    rows = []
    for name, pieces in served.items():
        if name not in trained:
            continue
        # both sides see the same [B, T] batch (the trainer in micro-batches, concatenated here)
        x_engine = torch.cat([p.reshape(-1, p.shape[-1]) for p in pieces]).cpu()[real]
        x_trainer = torch.cat([p.reshape(-1, p.shape[-1]) for p in trained[name]]).cpu()[real]
        (q_t, s_t), (q_e, s_e) = _codes(x_trainer, cfg), _codes(x_engine, cfg)
        distance = (x_trainer.float() - x_engine.float()).abs()
        exponent = torch.frexp(x_engine.float().abs().clamp_min(torch.finfo(torch.bfloat16).tiny))[1]
        ulps = distance / torch.ldexp(torch.ones_like(distance), exponent - 8)  # bf16: 8 significant bits
        rows.append((
            name.removeprefix("model."), float((q_t != q_e).float().mean()), float((s_t != s_e).float().mean()),
            float((x_trainer != x_engine).float().mean()), float(ulps.median()),
        ))  # fmt: skip
    return rows


def print_flips(precision: str, rows: list[tuple[str, float, float, float, float]]) -> None:
    print(f"\n{precision}: activation codes, trainer vs engine, same sequences (real tokens)")
    print(f"  {'projection':34s} {'codes differ':>12s} {'scale differs':>13s} {'input differs':>13s} "
          f"{'median |dx| (ulp)':>17s}")  # fmt: skip
    for name, codes, scales, inputs, ulps in rows:
        print(f"  {name:34s} {codes:12.4f} {scales:13.4f} {inputs:13.4f} {ulps:17.2f}")
    if rows:
        print(f"  {'mean':34s} {sum(r[1] for r in rows) / len(rows):12.4f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny_moe")
    parser.add_argument(
        "--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"]
    )
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--precisions", nargs="+", default=list(PRECISIONS), choices=PRECISIONS)
    parser.add_argument(
        "--flips",
        action="store_true",
        help="also print per-projection activation code flips (FP8 precisions)",
    )
    parser.add_argument("overrides", nargs="*", help="extra config overrides, e.g. trainer.fp8_gemm=emulated")
    args = parser.parse_args()
    if args.precisions[0] != "bf16":
        args.precisions = ["bf16", *[p for p in args.precisions if p != "bf16"]]
    base = [f"model={args.model}", f"topology={'1gpu' if args.device == 'cuda' else 'cpu'}",
            "rollout.weight_sync.transport=in_process", "precision.emulate=true", *args.overrides]  # fmt: skip
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    seqs: RolloutBatch | None = None
    results: dict[str, tuple[float, float]] = {}
    flips: dict[str, list] = {}
    for precision in args.precisions:
        start = time.perf_counter()
        pair, cfg = build_pair([*base, f"precision={precision}"], args.device)
        try:
            pair.sync(1)
            pair.verify_engine_matches_trainer()
            if seqs is None:
                seqs = sample_sequences(pair, cfg, args.prompts, args.group)
            results[precision] = mismatch(pair, cfg, seqs)
            if args.flips and precision in ("fp8_blockwise", "mxfp8"):
                flips[precision] = activation_flips(pair, cfg, seqs)
        finally:
            pair.shutdown()
        mean, worst = results[precision]
        print(
            f"{precision:14s} mean |dlogp| {mean:.5f}  max {worst:.4f}  ({time.perf_counter() - start:.1f} s)"
        )
    assert seqs is not None
    for precision, rows in flips.items():
        print_flips(precision, rows)
    tokens = int(seqs.response_mask.sum())
    print(f"\n{args.model}, {len(seqs)} sequences ({tokens} response tokens) sampled once by the bf16 engine, "
          f"{device_name}, torch {torch.__version__}\n")  # fmt: skip
    print(f"{'metric':34s} {'ours':>9s} {'baseline (bf16)':>16s} {'ratio':>6s}  device")
    base_mean = results["bf16"][0]
    for precision, (mean, _) in results.items():
        if precision == "bf16":
            continue
        # both sides computing the same function (trainer.compute_dtype=bf16 on the CPU) gives 0 / 0
        ratio = mean / base_mean if base_mean else (1.0 if mean == 0 else float("inf"))
        print(f"{'M5 mismatch ' + precision:34s} {mean:9.5f} {base_mean:16.5f} {ratio:6.2f}  {device_name}")


if __name__ == "__main__":
    main()
