"""Checks that need the quantization plan (so they cannot live in skyq.config, which imports nothing).

- The INT4 QAT contract: the trainer's fake-quant scope and the rollout checkpoint's quantized set are
  the same modules, both compared through the one per-parameter plan.
- The embedded pair's fit: trainer=torch holds the whole model (fp32 master weights, gradients, AdamW
  moments and the compute copy) in one process on one device, and rollout=embedded the whole model
  in its wire format in another (or the same one): a model past what that placement holds is
  refused with its numbers, before a dry run prints a plan the backend would not follow.
"""

from __future__ import annotations

from skyq.config.checkpoint_info import read_checkpoint_quantization
from skyq.config.enums import ComputeDtype, Device, Precision, RolloutBackend, TrainerBackend
from skyq.config.schema import CheckpointConfig, ModelConfig, PrecisionConfig, TrainConfig
from skyq.config.validate import ConfigValidationError
from skyq.quant.plan import QuantPlan, build_plan

EMBEDDED_MAX_PARAMS = 2e9
"""Largest model the embedded native trainer + engine pair is meant to hold (one device each side)."""

GB = 1e9


def plan_errors(*, model: ModelConfig, precision: PrecisionConfig, checkpoint: CheckpointConfig) -> list[str]:
    """Disagreements between the run's plan and its rollout checkpoint's quantized set."""
    path = checkpoint.rollout_checkpoint
    if precision.name is not Precision.int4_qat or path is None:
        return []
    info = read_checkpoint_quantization(path)
    if info is None or info.ct_format != "pack-quantized":
        return []  # absent (reported as skipped) or the wrong format (already refused by validate)
    ignore = list(info.block.get("ignore") or [])
    disagreements = build_plan(model, precision).check_ignore_list(ignore)
    if not disagreements:
        return []
    shown = "; ".join(disagreements[:5]) + (
        f"; ... ({len(disagreements)} in all)" if len(disagreements) > 5 else ""
    )
    return [
        f"checkpoint.rollout_checkpoint={path} quantizes a different module set than "
        f"precision.qat_scope={precision.qat_scope.value} fake-quantizes in training: {shown}. Fix: re-convert "
        "with python -m skyq.tools.convert_hf_to_int4 (its ignore list comes from the same plan), or set "
        "precision.qat_scope to what the checkpoint quantizes."
    ]


def embedded_trainer_bytes(cfg: TrainConfig, params: float) -> float:
    """What trainer=torch keeps per model: fp32 master weights, fp32 gradients and two fp32 AdamW
    moments (16 B a parameter), the compute-dtype copy the forward runs on, and the frozen KL
    reference in the compute dtype when algorithm.kl_coef > 0."""
    compute = 2 if cfg.trainer.compute_dtype is ComputeDtype.bf16 else 4
    return params * (16 + compute + (compute if cfg.algorithm.kl_coef > 0 else 0))


def fit_errors(cfg: TrainConfig, plan: QuantPlan) -> list[str]:
    """The embedded pair's model-size limit, with the bytes each side would hold."""
    if cfg.trainer.backend is not TrainerBackend.torch and cfg.rollout.backend is not RolloutBackend.embedded:
        return []
    params = plan.bf16_bytes / 2
    if params <= EMBEDDED_MAX_PARAMS:
        return []
    where = "this machine's CPU" if cfg.topology.device is Device.cpu else "one GPU"
    sides = []
    if cfg.trainer.backend is TrainerBackend.torch:
        sides.append(
            f"trainer=torch holds all of it on {where} ({embedded_trainer_bytes(cfg, params) / GB:.0f} GB: "
            "fp32 weights, gradients and AdamW moments plus the compute copy)"
        )
    if cfg.rollout.backend is RolloutBackend.embedded:
        sides.append(
            f"rollout=embedded all of it on {where} ({plan.wire_bytes / GB:.0f} GB in the "
            f"{plan.precision.value} wire format)"
        )
    return [
        f"model={cfg.model.name} has {params / 1e9:.1f}B parameters: {' and '.join(sides)}; the embedded pair "
        f"is meant for models up to {EMBEDDED_MAX_PARAMS / 1e9:.0f}B (e.g. model=tiny_moe, small_moe) and uses "
        "no model parallelism. Fix: trainer=megatron rollout=vllm on a GPU topology, or a smaller model."
    ]


def check(cfg: TrainConfig) -> QuantPlan:
    """Every plan-level check of a run (after `validate`); returns the plan for the dry run."""
    plan = build_plan(cfg.model, cfg.precision)
    errors = plan_errors(model=cfg.model, precision=cfg.precision, checkpoint=cfg.checkpoint)
    errors += fit_errors(cfg, plan)
    if errors:
        raise ConfigValidationError(errors)
    return plan
