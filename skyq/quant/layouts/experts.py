"""Routed experts: transformers-5 fused 3-D tensors <-> per-expert HF tensors.

transformers 5 keeps each MoE layer's routed experts as two fused parameters of the module
`<layer>.mlp.experts`: `gate_up_proj` (E, 2I, H) with the gate rows first, then the up rows, and
`down_proj` (E, H, I). HF checkpoints (and `save_pretrained`, which converts on save) store
`<layer>.mlp.experts.{e}.{gate_proj,up_proj,down_proj}.weight` of shapes (I, H), (I, H), (H, I).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from skyq.config.schema import ModelConfig

if TYPE_CHECKING:
    from torch import Tensor

FUSED_LEAVES = ("gate_up_proj", "down_proj")
PROJECTIONS_OF: dict[str, tuple[str, ...]] = {
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}
FUSED_LEAF_OF: dict[str, str] = {p: leaf for leaf, projs in PROJECTIONS_OF.items() for p in projs}
_EXPERTS_MODULE = ".mlp.experts"


class ExpertLayoutError(ValueError):
    """A fused or per-expert tensor whose name, shape or membership does not fit the model config."""


def parse_fused_name(name: str) -> tuple[str, str] | None:
    """`<layer>.mlp.experts.gate_up_proj` -> (`<layer>.mlp.experts`, `gate_up_proj`); None otherwise."""
    module, _, leaf = name.rpartition(".")
    if leaf in FUSED_LEAVES and module.endswith(_EXPERTS_MODULE):
        return module, leaf
    return None


def parse_expert_name(name: str) -> tuple[str, int, str] | None:
    """`<layer>.mlp.experts.{e}.{proj}.weight` -> (`<layer>.mlp.experts`, e, proj); None otherwise."""
    parts = name.rsplit(".", 3)
    if len(parts) != 4:
        return None
    module, expert, projection, leaf = parts
    if leaf != "weight" or projection not in FUSED_LEAF_OF or not expert.isdigit():
        return None
    if not module.endswith(_EXPERTS_MODULE):
        return None
    return module, int(expert), projection


def fused_name(module: str, projection: str) -> str:
    """The fused trainer tensor that holds `projection` of the experts module `module`."""
    return f"{module}.{FUSED_LEAF_OF[projection]}"


def fused_shape(leaf: str, model_cfg: ModelConfig) -> tuple[int, int, int]:
    """(E, 2I, H) for `gate_up_proj`, (E, H, I) for `down_proj`."""
    e, h, i = model_cfg.num_experts, model_cfg.hidden_size, model_cfg.moe_intermediate_size
    return (e, 2 * i, h) if leaf == "gate_up_proj" else (e, h, i)


def projection_stacks(name: str, tensor: Tensor, model_cfg: ModelConfig) -> list[tuple[str, Tensor]]:
    """Views (E, N, K) of each projection inside a fused expert tensor: gate then up, or down.

    The fake-quant and the serializer work on these, so a quantization block or group never
    straddles the gate/up boundary or two experts.
    """
    parsed = parse_fused_name(name)
    if parsed is None:
        raise ExpertLayoutError(
            f"{name}: not a fused expert tensor (`...mlp.experts.{{gate_up_proj,down_proj}}`)"
        )
    leaf = parsed[1]
    expected = fused_shape(leaf, model_cfg)
    if tuple(tensor.shape) != expected:
        raise ExpertLayoutError(
            f"{name}: shape {tuple(tensor.shape)} does not match the model config's {expected} "
            f"(num_experts={model_cfg.num_experts}, hidden_size={model_cfg.hidden_size}, "
            f"moe_intermediate_size={model_cfg.moe_intermediate_size})"
        )
    if leaf == "down_proj":
        return [("down_proj", tensor)]
    i = model_cfg.moe_intermediate_size
    return [("gate_proj", tensor[:, :i]), ("up_proj", tensor[:, i:])]


def stack_projections(
    trainer_name: str, members: Mapping[tuple[str, int], Tensor], model_cfg: ModelConfig
) -> Tensor:
    """Stack per-expert 2-D tensors keyed by (projection, expert) into the fused trainer tensor."""
    import torch  # here, not at the top: the layouts' name and shape rules are used without torch

    leaf = trainer_name.rpartition(".")[2]
    projections = PROJECTIONS_OF[leaf]
    missing = [
        f"{p}[{e}]" for p in projections for e in range(model_cfg.num_experts) if (p, e) not in members
    ]
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise ExpertLayoutError(f"{trainer_name}: cannot fuse, missing expert tensors {shown}")
    stacks = [torch.stack([members[(p, e)] for e in range(model_cfg.num_experts)]) for p in projections]
    fused = stacks[0] if len(stacks) == 1 else torch.cat(stacks, dim=1)
    expected = fused_shape(leaf, model_cfg)
    if tuple(fused.shape) != expected:
        raise ExpertLayoutError(
            f"{trainer_name}: per-expert tensors stack to {tuple(fused.shape)}, the model config needs {expected}"
        )
    return fused
