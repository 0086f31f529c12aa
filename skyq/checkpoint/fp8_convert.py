"""BF16 -> FP8 e4m3: the shard transform and the config block of `convert_hf_to_fp8`.

Strategies (seed-compatible names):
- `block`: `X.weight_scale_inv` fp32 [ceil(N/bn), ceil(K/bk)], `quant_method: fp8` with
  `weight_block_size` (DeepSeek-V3 layout); `pow2` scales add `scale_fmt: ue8m0`.
- `channel`: `X.weight_scale` fp32 [N, 1], compressed-tensors `float-quantized`.
- `tensor`: `X.weight_scale` fp32 [1], `quant_method: fp8` without a block size.
All arithmetic is skyq.quant.fp8_blockwise, the same functions the trainer and the sync use; on a
GPU through skyq.quant's kernel dispatch, and for BF16 blockwise on the CPU through
`fp8_cpu_kernel`, both bit-identical to it.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch

from skyq.checkpoint import fp8_cpu_kernel
from skyq.checkpoint.chunking import quantize_by_rows
from skyq.checkpoint.errors import CheckpointError
from skyq.checkpoint.pipeline import ShardTransform, tensorwise_transform
from skyq.checkpoint.reader import TensorInfo
from skyq.config.enums import Precision, ScaleFormat
from skyq.config.schema import PrecisionConfig
from skyq.config.shard_rules import ShardCheck
from skyq.quant import fp8_blockwise
from skyq.quant.kernels import dispatch
from skyq.quant.layouts import Role
from skyq.quant.plan import QuantPlan
from skyq.quant.strategies import get_strategy


class Fp8Strategy(str, Enum):
    block = "block"
    channel = "channel"
    tensor = "tensor"


@dataclass(frozen=True)
class Fp8Options:
    strategy: Fp8Strategy = Fp8Strategy.block
    block_size: tuple[int, int] = (128, 128)
    pow2_scales: bool = False
    """Power-of-two scales (what `scale_fmt: ue8m0` promises); block strategy only."""

    def __post_init__(self) -> None:
        if self.pow2_scales and self.strategy is not Fp8Strategy.block:
            raise ValueError(
                f"--scale-fmt ue8m0 needs --strategy block, got --strategy {self.strategy.value}"
            )

    def precision_config(self) -> PrecisionConfig:
        """The fp8_blockwise precision whose scope and plan this conversion follows (block size and
        scale format are the block strategy's; the scope is the same for every strategy)."""
        scale_format = ScaleFormat.ue8m0 if self.pow2_scales else ScaleFormat.fp32
        return PrecisionConfig(
            name=Precision.fp8_blockwise, block_size=list(self.block_size), scale_format=scale_format
        )

    def scale_suffix(self) -> str:
        return "_scale_inv" if self.strategy is Fp8Strategy.block else "_scale"


def make_fp8_transform(quantized: frozenset[str], opts: Fp8Options) -> ShardTransform:
    quantize: Callable[[torch.Tensor, str], tuple[torch.Tensor, torch.Tensor]]
    if opts.strategy is Fp8Strategy.block:

        def quantize(w: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
            if w.is_cuda:
                return dispatch.quantize_fp8_blockwise(
                    w, block_size=opts.block_size, pow2_scale=opts.pow2_scales, name=name
                )
            fast = fp8_cpu_kernel.quantize_blockwise(
                w, block_size=opts.block_size, pow2_scale=opts.pow2_scales
            )
            if fast is not None:
                return fast

            def blockwise(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                return fp8_blockwise.quantize(
                    rows, block_size=opts.block_size, pow2_scale=opts.pow2_scales, name=name
                )

            return quantize_by_rows(w, blockwise, multiple=opts.block_size[0])

    elif opts.strategy is Fp8Strategy.channel:

        def quantize(w: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
            return quantize_by_rows(
                w, lambda rows: fp8_blockwise.quantize_per_channel(rows, name=name), multiple=1
            )

    else:

        def quantize(w: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
            return fp8_blockwise.quantize_per_tensor(w, name=name)

    def convert(name: str, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        q, scale_inv = quantize(tensors[name], name)
        return {name: q, name + opts.scale_suffix(): scale_inv}

    return tensorwise_transform(convert, converts=quantized)


def check_fp8_input(dtypes: dict[str, str]) -> None:
    """Refuse an input that is already quantized: this tool reads BF16/FP16/FP32 releases only."""
    foreign = sorted(n for n, d in dtypes.items() if d in ("F8_E4M3", "F8_E5M2", "I32", "U8", "I8"))
    if foreign:
        raise CheckpointError(
            f"tensor {foreign[0]!r} is {dtypes[foreign[0]]}: the input looks already quantized; "
            "convert it to BF16 first (convert_fp8_to_bf16 / convert_moe_int4_to_bf16)"
        )


_CHANNEL_GROUP = {
    "input_activations": {"actorder": None, "block_structure": None, "dynamic": True, "group_size": None,
                          "num_bits": 8, "observer": None, "observer_kwargs": {}, "strategy": "token",
                          "symmetric": True, "type": "float"},
    "output_activations": None,
    "targets": ["Linear"],
    "weights": {"actorder": None, "block_structure": None, "dynamic": False, "group_size": None, "num_bits": 8,
                "observer": "minmax", "observer_kwargs": {}, "strategy": "channel", "symmetric": True,
                "type": "float"},
}  # fmt: skip


def fp8_quantization_config(opts: Fp8Options, plan: QuantPlan) -> dict[str, Any]:
    """The `quantization_config` block of each strategy, for a plan of `opts.precision_config()`.

    `block` is the fp8_blockwise strategy's own block (the one a run's engine boots from, the
    strategy being the one owner of it); `tensor` is that block without `weight_block_size` (one
    scale per tensor: vLLM's per-tensor FP8). `channel` is compressed-tensors `float-quantized`
    with the plan's ignore list; no run precision serves it, so no strategy owns it.
    """
    if opts.strategy is Fp8Strategy.channel:
        return {
            "config_groups": {"group_0": copy.deepcopy(_CHANNEL_GROUP)},
            "format": "float-quantized",
            "ignore": plan.ignore_list(),
            "kv_cache_scheme": None,
            "quant_method": "compressed-tensors",
            "quantization_status": "compressed",
        }
    block = get_strategy(opts.precision_config()).quantization_config(plan)
    if opts.strategy is Fp8Strategy.tensor:
        del block["weight_block_size"]
    return block


MERGED_PROJECTIONS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
"""Sibling projections vLLM loads as one linear (qkv_proj, gate_up_proj; routed experts' w13)."""


def merged_row_warnings(
    quantized: frozenset[str], tensors: dict[str, TensorInfo], roles: dict[str, Role], *, block_rows: int
) -> list[str]:
    """One warning per (projection, rows) whose members vLLM will refuse to boot with blockwise FP8.

    vLLM merges q/k/v and gate/up into one linear and requires each member's rows per TP shard to
    be a multiple of the block's rows: always for routed experts (w13), and for the others every
    member but the last at TP 1 (the last only when sharded). A member whose rows are not a multiple
    of the block at TP 1 is a multiple at no TP. The arithmetic is `shard_rules.ShardCheck`'s, the
    rule config validation applies to a run's shards.
    """
    members: dict[tuple[str, tuple[str, ...]], list[str]] = {}
    for name in quantized:
        parent, _, leaf = name.removesuffix(".weight").rpartition(".")
        family = next((f for f in MERGED_PROJECTIONS if leaf in f), None)
        if family is not None:
            members.setdefault((parent, family), []).append(leaf)
    failing: dict[tuple[ShardCheck, tuple[str, ...], bool], list[str]] = {}
    for (parent, family), leaves in members.items():
        present = [leaf for leaf in family if leaf in leaves]
        if len(present) < 2:
            continue
        for leaf in present:
            name = f"{parent}.{leaf}.weight"
            check = ShardCheck(
                side="engine", tensor=leaf, dim_key=f"{leaf} rows", dim=tensors[name].shape[0], shards=1,
                shards_key="engine TP", divisor=block_rows, divisor_key="--block-size BN",
            )  # fmt: skip
            if not check.ok:
                tp1_exempt = leaf == present[-1] and roles[name] is not Role.routed_expert
                failing.setdefault((check, family, tp1_exempt), []).append(name)
    warnings = []
    for (check, family, tp1_exempt), names in sorted(failing.items(), key=lambda item: sorted(item[1])[0]):
        verdict = (
            "vLLM accepts this member at TP 1 only (the last member of a merged linear is exempt there)"
            if tp1_exempt
            else "vLLM refuses this member at every TP"
        )
        warnings.append(
            f"warning: {len(names)} {check.tensor} weight(s) (e.g. {sorted(names)[0]!r}), merged as "
            f"{'/'.join(family)} by vLLM: {check.arithmetic()}; {verdict}. Fix: a --block-size BN "
            f"dividing {check.dim} (e.g. {math.gcd(check.dim, block_rows)})"
        )
    return warnings
