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
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch

from skyq.checkpoint import fp8_cpu_kernel
from skyq.checkpoint.chunking import quantize_by_rows
from skyq.checkpoint.errors import CheckpointError
from skyq.checkpoint.pipeline import ShardTransform, tensorwise_transform
from skyq.quant import fp8_blockwise
from skyq.quant.kernels import dispatch


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


def fp8_quantization_config(opts: Fp8Options, kept_modules: tuple[str, ...]) -> dict[str, Any]:
    """The `quantization_config` block FORMATS.md fixes for each strategy (lists sorted)."""
    if opts.strategy is Fp8Strategy.channel:
        return {
            "config_groups": {"group_0": copy.deepcopy(_CHANNEL_GROUP)},
            "format": "float-quantized",
            "ignore": list(kept_modules),
            "kv_cache_scheme": None,
            "quant_method": "compressed-tensors",
            "quantization_status": "compressed",
        }
    block: dict[str, Any] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}
    if opts.strategy is Fp8Strategy.block:
        block["weight_block_size"] = list(opts.block_size)
        if opts.pow2_scales:
            block["scale_fmt"] = "ue8m0"
    block["modules_to_not_convert"] = list(kept_modules)
    return block
