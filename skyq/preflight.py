"""Checks that need the quantization plan (so they cannot live in skyq.config, which imports nothing).

The INT4 QAT contract: the trainer's fake-quant scope and the rollout checkpoint's quantized set are
the same modules. Both are compared through the one per-parameter plan.
"""

from __future__ import annotations

from skyq.config.checkpoint_info import read_checkpoint_quantization
from skyq.config.enums import Precision
from skyq.config.schema import CheckpointConfig, ModelConfig, PrecisionConfig
from skyq.config.validate import ConfigValidationError
from skyq.quant.plan import build_plan


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


def check(*, model: ModelConfig, precision: PrecisionConfig, checkpoint: CheckpointConfig) -> None:
    errors = plan_errors(model=model, precision=precision, checkpoint=checkpoint)
    if errors:
        raise ConfigValidationError(errors)
