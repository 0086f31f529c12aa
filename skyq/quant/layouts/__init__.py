"""Model quantization layouts: one per architecture family (`get_layout(family)`)."""

from __future__ import annotations

from skyq.config.enums import ModelFamily
from skyq.quant.layouts.base import (
    LINEAR_ROLES,
    ExpertSlot,
    LayoutError,
    ModelQuantizationLayout,
    ParamSpec,
    Role,
    hf_dtype_name,
)
from skyq.quant.layouts.deepseek_v3 import DeepseekV3Layout
from skyq.quant.layouts.qwen3_moe import Qwen3MoeLayout

_LAYOUTS: dict[ModelFamily, ModelQuantizationLayout] = {
    ModelFamily.qwen3_moe: Qwen3MoeLayout(),
    ModelFamily.deepseek_v3: DeepseekV3Layout(),
}


def get_layout(family: ModelFamily | str) -> ModelQuantizationLayout:
    """The layout of an architecture family (`tiny_moe` is a qwen3_moe model)."""
    try:
        return _LAYOUTS[ModelFamily(family)]
    except ValueError:
        known = ", ".join(f.value for f in _LAYOUTS)
        raise LayoutError(
            f"model.family={family!r}: no quantization layout; known families: {known}"
        ) from None


__all__ = [
    "LINEAR_ROLES",
    "DeepseekV3Layout",
    "ExpertSlot",
    "LayoutError",
    "ModelQuantizationLayout",
    "ParamSpec",
    "Qwen3MoeLayout",
    "Role",
    "get_layout",
    "hf_dtype_name",
]
