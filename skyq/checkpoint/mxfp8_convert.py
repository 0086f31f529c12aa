"""BF16 -> MXFP8 (compressed-tensors `mxfp8-quantized`): the shard transform and config block.

The strategy of `precision=mxfp8` (`skyq.quant.strategies.mxfp8`) does both: its `serialize` makes
`X.weight` e4m3 [N, K] + `X.weight_scale` uint8 E8M0 [N, K/32] (the bytes the weight sync pushes),
and its `quantization_config(plan)` is the block (`convert_hf_to_mxfp8` writes it for the plan that
`selection.checked_plan` matched to the shards), so a converted checkpoint is what the engine of an
mxfp8 run expects by construction.
"""

from __future__ import annotations

import torch

from skyq.checkpoint.chunking import quantize_by_rows
from skyq.checkpoint.errors import CheckpointError
from skyq.checkpoint.pipeline import ShardTransform, tensorwise_transform
from skyq.checkpoint.reader import TensorInfo
from skyq.checkpoint.selection import CheckpointSelection
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
