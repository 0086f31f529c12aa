"""BF16 -> MXFP8 (compressed-tensors `mxfp8-quantized`): the shard transform and config block.

The strategy of `precision=mxfp8` (`skyq.quant.strategies.mxfp8`) does both: its `serialize` makes
`X.weight` e4m3 [N, K] + `X.weight_scale` uint8 E8M0 [N, K/32] (the bytes the weight sync pushes),
and its `quantization_config(plan)` is the block, so a converted checkpoint is what the engine of an
mxfp8 run expects by construction.
"""

from __future__ import annotations

from typing import Any

import torch

from skyq.checkpoint.chunking import quantize_by_rows
from skyq.checkpoint.errors import CheckpointError
from skyq.checkpoint.int4_convert import matches_ignore_rule
from skyq.checkpoint.pipeline import ShardTransform, tensorwise_transform
from skyq.checkpoint.reader import TensorInfo
from skyq.checkpoint.selection import CheckpointSelection
from skyq.config.schema import ModelConfig
from skyq.quant.layouts import LINEAR_ROLES
from skyq.quant.plan import build_plan
from skyq.quant.strategies.base import QuantizationStrategy
from skyq.quant.strategies.mxfp8 import MX_BLOCK


def check_mx_divisibility(names: frozenset[str], tensors: dict[str, TensorInfo]) -> None:
    """Every quantized weight needs K % 32 == 0; refuse before writing anything, with the arithmetic."""
    for name in sorted(names):
        k = tensors[name].shape[-1]
        if k % MX_BLOCK:
            raise CheckpointError(
                f"tensor {name!r} in {tensors[name].shard}: MXFP8 needs K % {MX_BLOCK} == 0, but K = {k} = "
                f"{k // MX_BLOCK} * {MX_BLOCK} + {k % MX_BLOCK} (shape {list(tensors[name].shape)}); "
                "narrow --targets (routed_experts) or convert this model to another format"
            )


def make_mxfp8_transform(selection: CheckpointSelection, strategy: QuantizationStrategy) -> ShardTransform:
    def convert(name: str, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        role, scale_name = selection.roles[name], name + "_scale"

        def serialize(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            wire = strategy.serialize(name, rows, role=role)
            return wire[name], wire[scale_name]

        # Blocks are 1 x 32 along K: row slabs quantize independently, same bits as one call.
        q, scale = quantize_by_rows(tensors[name], serialize, multiple=1)
        return {name: q, scale_name: scale}

    return tensorwise_transform(convert, converts=selection.quantized)


def mxfp8_quantization_config(
    strategy: QuantizationStrategy,
    model_cfg: ModelConfig,
    selection: CheckpointSelection,
    tensors: dict[str, TensorInfo],
) -> dict[str, Any]:
    """The strategy's block for the plan of `model_cfg`, after checking that the plan quantizes exactly
    the checkpoint's selected tensors and its `ignore` list covers every linear kept bf16."""
    plan = build_plan(model_cfg, strategy.precision_cfg)
    planned = {p.name for p in plan if p.quantized}
    differ = sorted(planned ^ selection.quantized)
    if differ:
        side = "the checkpoint lacks" if differ[0] in planned else "the config.json plan does not quantize"
        raise CheckpointError(
            f"tensor {differ[0]!r}: {side} it ({len(differ)} quantized tensor(s) differ between config.json "
            "and the shards); the checkpoint does not match its config"
        )
    block = strategy.quantization_config(plan)
    kept_linear = sorted(
        n.removesuffix(".weight")
        for n, role in selection.roles.items()
        if role in LINEAR_ROLES
        and n.endswith(".weight")
        and len(tensors[n].shape) == 2
        and n not in selection.quantized
    )
    unlisted = [m for m in kept_linear if not any(matches_ignore_rule(m, r) for r in block["ignore"])]
    if unlisted:
        raise CheckpointError(
            f"module {unlisted[0]!r} stays bf16 but the plan of config.json does not list it in `ignore` "
            "(an engine would look for its MXFP8 form); the checkpoint does not match its config"
        )
    return block
