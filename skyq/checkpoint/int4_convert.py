"""BF16 -> W4A16 (compressed-tensors `pack-quantized`): the shard transform and config block.

Symmetric groups of G along K with skyq.quant.int4 (the trainer's STE arithmetic, so the served
weights are the ones QAT trained against): `X.weight_packed` int32 [N, K/8], `X.weight_scale` bf16
[N, K/G], `X.weight_shape` int64 [2]. Asymmetric output (zero points in compressed-tensors layout)
exists only for compatibility and cannot serve INT4 QAT.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

from skyq.checkpoint.chunking import quantize_by_rows
from skyq.checkpoint.errors import CheckpointError
from skyq.checkpoint.pipeline import ShardTransform, tensorwise_transform
from skyq.checkpoint.reader import TensorInfo
from skyq.config.enums import Int4Grid, Precision
from skyq.config.schema import PrecisionConfig
from skyq.quant import int4
from skyq.quant.kernels import dispatch
from skyq.quant.plan import QuantPlan
from skyq.quant.strategies import get_strategy


@dataclass(frozen=True)
class Int4Options:
    group_size: int
    grid: Int4Grid = Int4Grid.kimi
    symmetric: bool = True

    def precision_config(self) -> PrecisionConfig:
        """The int4_qat precision whose scope, plan and block this conversion follows."""
        return PrecisionConfig(name=Precision.int4_qat, int4_group_size=self.group_size, int4_grid=self.grid)


def matches_ignore_rule(module: str, rule: str) -> bool:
    """compressed-tensors semantics: `re:` patterns are `re.match`ed on module names, else equality."""
    return re.match(rule[3:], module) is not None if rule.startswith("re:") else module == rule


def check_group_divisibility(names: frozenset[str], tensors: dict[str, TensorInfo], group_size: int) -> None:
    """Every quantized weight needs K % G == 0 and K % 8 == 0 (packing); refuse before writing anything."""
    if group_size <= 0:
        raise CheckpointError(f"--group-size must be positive, got {group_size}")
    for name in sorted(names):
        k = tensors[name].shape[-1]
        if k % group_size or k % 8:
            raise CheckpointError(
                f"tensor {name!r} in {tensors[name].shard}: K = {k} is not divisible by the group size "
                f"{group_size} ({k} = {k // group_size} * {group_size} + {k % group_size}); pick a --group-size "
                "dividing every quantized K (32 or 128 for the supported models)"
            )


def make_int4_transform(quantized: frozenset[str], opts: Int4Options) -> ShardTransform:
    def quantize(name: str, w: torch.Tensor) -> dict[str, torch.Tensor]:
        base = name.removesuffix(".weight")
        if opts.symmetric:

            def symmetric(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                if rows.is_cuda:
                    return dispatch.quantize_int4_packed(
                        rows, group_size=opts.group_size, grid=opts.grid, name=name
                    )
                return int4.quantize_packed(rows, group_size=opts.group_size, grid=opts.grid, name=name)

            packed, scale = quantize_by_rows(w, symmetric, multiple=1)
            extra = {}
        else:
            q, scale, zp = int4.quantize_asymmetric(w, group_size=opts.group_size, name=name)
            packed = int4.pack(q, name=name)
            extra = {f"{base}.weight_zero_point": int4.pack_zero_point(zp, name=name)}
        return {
            f"{base}.weight_packed": packed,
            f"{base}.weight_scale": scale,
            f"{base}.weight_shape": int4.weight_shape_tensor(*w.shape),
            **extra,
        }

    return tensorwise_transform(lambda name, tensors: quantize(name, tensors[name]), converts=quantized)


def int4_quantization_config(opts: Int4Options, plan: QuantPlan, ignore_rules: list[str]) -> dict[str, Any]:
    """The int4_qat strategy's block for `plan` (the one owner of it: the engine of an int4_qat run
    boots from it), with the converter's two options applied: the user's `--ignore-rules` appended
    verbatim to `ignore` (they match the modules kept bf16 beyond the plan), and `symmetric: false`
    for `--asymmetric` (compatibility output only; the strategy never writes zero points)."""
    block = get_strategy(opts.precision_config()).quantization_config(plan)
    block["ignore"] = [*block["ignore"], *sorted(set(ignore_rules))]
    block["config_groups"]["group_0"]["weights"]["symmetric"] = opts.symmetric
    return block
