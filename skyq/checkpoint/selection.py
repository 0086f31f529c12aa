"""Which tensors of a checkpoint a precision quantizes: the layout's role of every tensor name.

Converters see only tensor names; the layout of the checkpoint's family (from config.json) gives
each name its role, and the precision's strategy (`skyq.quant.strategies`) says which are quantized
- the same rule the trainer's fake-quant, the plan and the weight sync follow. A name the layout does not know is an error
naming it: a converter must never guess what an unknown tensor is.
"""

from __future__ import annotations

from dataclasses import dataclass

from skyq.checkpoint.errors import CheckpointError
from skyq.checkpoint.reader import TensorInfo
from skyq.config.schema import ModelConfig, PrecisionConfig
from skyq.quant.layouts import LayoutError, Role, get_layout
from skyq.quant.strategies import get_strategy


@dataclass(frozen=True)
class CheckpointSelection:
    roles: dict[str, Role]
    quantized: frozenset[str]
    """2-D `.weight` tensors whose role the scope quantizes."""
    kept_modules: tuple[str, ...]
    """Sorted modules owning a 2-D `.weight` that stays unquantized (engines' skip/ignore list)."""


def select(
    tensors: dict[str, TensorInfo], model_cfg: ModelConfig, precision_cfg: PrecisionConfig
) -> CheckpointSelection:
    """Roles of every tensor and the set the precision quantizes; CheckpointError naming an unknown tensor."""
    layout = get_layout(model_cfg.family)
    roles: dict[str, Role] = {}
    for name in sorted(tensors):
        try:
            roles[name] = layout.role(name, model_cfg)
        except LayoutError as e:
            raise CheckpointError(
                f"tensor {name!r} in {tensors[name].shard}: {e} (model config derived from config.json)"
            ) from e
    strategy = get_strategy(precision_cfg)
    linear = {n for n, info in tensors.items() if n.endswith(".weight") and len(info.shape) == 2}
    quantized = frozenset(n for n in linear if strategy.quantizes_param(n, tensors[n].shape, roles[n]))
    kept = tuple(sorted({layout.module_name(n) for n in linear - quantized}))
    return CheckpointSelection(roles=roles, quantized=quantized, kept_modules=kept)
