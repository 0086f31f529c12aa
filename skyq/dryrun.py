"""`dry_run=true`: the resolved plan of a run, printed without touching a GPU.

Placement and parallel layout as the chosen backends will really run them (the embedded pair in the
driver's process on one GPU; every run of Ray actors, on the CPU too: the placement plan of
`skyq.launch.plan`, the same text the run and `simulate=true` print), the per-parameter quantization plan (from
the model config alone), bytes per weight sync, a per-GPU memory estimate, the shard-divisibility
table, the env vars and the packing alignment each GPU generation would resolve to (the driver never
guesses which it has).
"""

from __future__ import annotations

from skyq.config.enums import ComputeDtype, Device, Precision, RolloutBackend, TrainerBackend
from skyq.config.resolve import packing_alignment, resolve_worker
from skyq.config.schema import TrainConfig
from skyq.config.validate import ValidationReport, trainer_dp
from skyq.quant.layouts import Role
from skyq.quant.plan import QuantPlan
from skyq.quant.strategies import get_strategy

GIB = 2**30
CAPABILITIES = {"SM90 (Hopper)": (9, 0), "SM100 (Blackwell)": (10, 0)}


def render_plan(cfg: TrainConfig, report: ValidationReport, plan: QuantPlan) -> str:
    """The dry run's text, from the validated config, its report and its plan (`preflight.check`'s)."""
    sections = [
        f"skyq dry run: model={cfg.model.name} precision={cfg.precision.name.value} topology={cfg.topology.name} "
        f"trainer={cfg.trainer.backend.value} rollout={cfg.rollout.backend.value} task={cfg.task.name.value}",
        _placement(cfg),
        *_trainer_numerics(cfg),
        plan.summary(),
        _sync_bytes(plan),
        _memory(cfg, plan),
        _shards(report),
        _resolution(cfg),
    ]
    if report.skipped:
        sections.append("not checked (paths absent here):\n" + "\n".join(f"  - {s}" for s in report.skipped))
    sections.append("config valid; dry run only (nothing started).")
    return "\n\n".join(sections)


def _embedded(cfg: TrainConfig) -> bool:
    return cfg.trainer.backend is TrainerBackend.torch and cfg.rollout.backend is RolloutBackend.embedded


def _placement(cfg: TrainConfig) -> str:
    """Where the run's workers go, as the run itself prints it: the embedded pair in the driver's
    process on one GPU, else the placement plan its Ray actors are started from (`placement.run_plan`)."""
    from skyq.launch.placement import describe, describe_plan, run_placement, run_plan

    t, p, r = cfg.topology, cfg.topology.parallel, cfg.rollout
    placed = run_placement(t, cfg.trainer, r)
    plan = run_plan(t, cfg.trainer, r)
    if plan is None:
        return "\n".join(
            [
                "placement: the embedded pair in this process on the topology's one GPU",
                "  trainer: the whole model (no TP/PP/EP/DP); rollout: one embedded engine, the whole model",
                f"  sync: {describe(placed)}",
            ]
        )
    lines = [f"sync: {describe(placed)}"]
    if cfg.trainer.backend is TrainerBackend.torch:
        lines.append("trainer: the native trainer, one process with the whole model (no TP/PP/EP/DP)")
    elif p.pp > 1:
        lines.append(
            f"trainer: first/last pipeline stage layers {p.first_stage_layers}/{p.last_stage_layers}"
        )
    if r.backend is RolloutBackend.vllm:
        lines.append(
            f"engines: each one vLLM engine TP{r.tp_size or r.gpus_per_engine} DP{r.dp_size} EP{r.ep_size}, "
            f"memory fraction {r.gpu_memory_fraction}"
            + (" (on the CPU: one process, TP1)" if t.device is Device.cpu else "")
        )
    return describe_plan(plan) + "\n\n" + "\n".join(lines)


def _trainer_numerics(cfg: TrainConfig) -> list[str]:
    """The torch trainer's compute dtype: bf16 is the engine's, so both sides compute the same function."""
    if cfg.trainer.backend is not TrainerBackend.torch:
        return []
    t = cfg.trainer
    same = (
        "the rollout engine's activation dtype (lowest train/rollout mismatch)"
        if t.compute_dtype is ComputeDtype.bf16
        else "more precise than the engine's bf16: expect a larger train/rollout mismatch"
    )
    return [
        f"trainer numerics: forward/backward in {t.compute_dtype.value}, {same}; fp32 master weights and AdamW "
        f"state; fp8_gemm={t.fp8_gemm.value}"
    ]


def _sync_bytes(plan: QuantPlan) -> str:
    ratio = plan.wire_bytes / plan.bf16_bytes if plan.bf16_bytes else 1.0
    return (
        f"bytes per weight sync: {plan.wire_bytes / GIB:.3f} GiB ({plan.precision.value}) vs "
        f"{plan.bf16_bytes / GIB:.3f} GiB (bf16), ratio {ratio:.3f}"
    )


def _memory(cfg: TrainConfig, plan: QuantPlan) -> str:
    """Per-GPU estimate: bf16 weights, fp32 grads, Adam (fp32 master + moments) over the DP shards;
    for the embedded pair, what its one trainer and its one engine hold."""
    t, p = cfg.topology, cfg.topology.parallel
    if t.device is Device.cpu:
        return f"memory: {plan.bf16_bytes / 2 / 1e6:.2f} M parameters on the CPU"
    if _embedded(cfg):
        from skyq.preflight import embedded_trainer_bytes

        trainer = embedded_trainer_bytes(cfg, plan.bf16_bytes / 2)
        return "\n".join(
            [
                "memory estimate (the embedded pair: the whole model on each side):",
                f"  trainer GPU: {trainer / GIB:.2f} GiB (fp32 weights, grads, AdamW moments, compute copy)",
                f"  engine GPU: {plan.wire_bytes / GIB:.2f} GiB ({plan.precision.value} wire format)",
            ]
        )
    expert = sum(x.bf16_bytes // 2 for x in plan if x.role is Role.routed_expert)
    dense = sum(x.bf16_bytes // 2 for x in plan) - expert
    per_gpu = dense / (p.tp * p.pp) + expert / (p.ep * p.etp * p.pp)
    dp = trainer_dp(cfg)
    expert_dp = max(p.tp * p.cp * dp // (p.ep * p.etp), 1)
    opt_bytes = 8 if cfg.trainer.optimizer.precision_aware else 12  # master fp32 + 2 moments (fp32 or bf16)
    optimizer = (dense / (p.tp * p.pp) / dp + expert / (p.ep * p.etp * p.pp) / expert_dp) * opt_bytes
    where = "host (cpu_offload)" if cfg.trainer.optimizer.cpu_offload else "GPU"
    engine_gpu = plan.wire_bytes / cfg.rollout.gpus_per_engine
    return "\n".join(
        [
            "memory estimate per GPU (trainer: bf16 weights, fp32 grads, distributed Adam):",
            f"  trainer weights {per_gpu * 2 / GIB:.2f} GiB, grads {per_gpu * 4 / GIB:.2f} GiB, "
            f"optimizer {optimizer / GIB:.2f} GiB on {where}",
            f"  engine weights ({plan.precision.value} wire format) {engine_gpu / GIB:.2f} GiB of "
            f"{cfg.rollout.gpu_memory_fraction:.0%} of the GPU",
        ]
    )


def _shards(report: ValidationReport) -> str:
    if not report.shard_checks:
        return "shard divisibility: nothing to check (bf16, or unsharded CPU run)"
    rows = [f"  [{c.side:<7}] {c.tensor}: {c.arithmetic()}" for c in report.shard_checks]
    return "shard divisibility:\n" + "\n".join(rows)


def _resolution(cfg: TrainConfig) -> str:
    """What each GPU generation would resolve to; the real run asks its workers and requires agreement."""
    strategy = get_strategy(cfg.precision)
    p = cfg.topology.parallel
    lines = [
        "per-worker resolution (fp8_recipe, scale format, env, packing alignment; asked of the workers at start):"
    ]
    if cfg.topology.device is Device.cpu:
        lines.append("  CPU: no GPU, recipe stays `auto`; the embedded run emulates the formats exactly")
        return "\n".join(lines)
    for label, cap in CAPABILITIES.items():
        try:
            res = resolve_worker(cfg.precision, cap)
            env = strategy.env_vars(res.fp8_recipe)
        except ValueError as exc:  # ResolutionError, or the strategy refusing the resolved recipe
            lines.append(f"  {label}: refused: {exc}")
            continue
        align = packing_alignment(cfg.precision, res, tp=p.tp, cp=p.cp)
        recipe = res.fp8_recipe.value if cfg.precision.name is not Precision.bf16 else "-"
        lines.append(
            f"  {label}: recipe {recipe}, scales {res.scale_format.value}"
            f"{' (emulated)' if res.emulated else ''}, packing alignment {align} tokens"
        )
        for side in ("trainer", "engine"):
            merged = {**env[side], **(cfg.trainer.env if side == "trainer" else cfg.rollout.env)}
            lines.append(
                f"    {side} env: " + (" ".join(f"{k}={v}" for k, v in sorted(merged.items())) or "(none)")
            )
    return "\n".join(lines)
