"""FP8 e4m3 -> BF16: reading the scale layout from config.json, pairing every weight with its scale.

Accepted inputs: `quant_method: fp8` with `weight_block_size` (DeepSeek-V3 / Qwen-FP8 blockwise,
`X.weight_scale_inv`), `quant_method: fp8` without it (per-tensor `X.weight_scale`), and
compressed-tensors `float-quantized` (per-channel or per-tensor `X.weight_scale`) and compressed-tensors
`mxfp8-quantized` (uint8 E8M0 `X.weight_scale` [N, K/32], skyq.quant.mxfp8). Any other
`quant_method` is refused. A weight without its scale, a scale without its weight, a scale of the
wrong shape or dtype, non-finite or non-positive scales and NaN codes are refused naming the tensor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from skyq.checkpoint.errors import CheckpointError
from skyq.checkpoint.hf_config import text_config_of
from skyq.checkpoint.pipeline import ShardTransform, tensorwise_transform
from skyq.checkpoint.reader import ShardedCheckpoint, TensorInfo
from skyq.quant import fp8_blockwise, mxfp8
from skyq.quant.kernels import dispatch

FP8_DTYPE = "F8_E4M3"


@dataclass(frozen=True)
class Fp8Layout:
    """How the scales of an FP8 checkpoint are laid out."""

    scale_suffix: str  # "_scale_inv" (blockwise) or "_scale"
    block_size: tuple[int, int] | None  # None: one scale per row ([N,1]) or per tensor ([1] / [])
    e8m0: bool = False
    """MXFP8: uint8 E8M0 exponents (`2^(s - 127)`) in 1 x 32 blocks instead of fp32 scales."""

    @property
    def scale_dtype(self) -> str:
        return "U8" if self.e8m0 else "F32"


def find_quantization_config(hf_json: dict[str, Any]) -> dict[str, Any] | None:
    """`quantization_config` at the root of config.json, else under `text_config`."""
    block = hf_json.get("quantization_config")
    if block is None:
        block = text_config_of(hf_json).get("quantization_config")
    return block


def fp8_layout_from_config(config: dict[str, Any], where: str) -> Fp8Layout:
    block = find_quantization_config(config)
    if block is None:
        raise CheckpointError(f"{where}: no quantization_config; this is not an FP8 checkpoint")
    method = block.get("quant_method")
    if method == "fp8":
        size = block.get("weight_block_size")
        if size is None:
            return Fp8Layout("_scale", None)
        if not (
            isinstance(size, list) and len(size) == 2 and all(isinstance(b, int) and b > 0 for b in size)
        ):
            raise CheckpointError(f"{where}: weight_block_size must be two positive ints, got {size!r}")
        return Fp8Layout("_scale_inv", (size[0], size[1]))
    if method == "compressed-tensors" and block.get("format") == "float-quantized":
        return Fp8Layout("_scale", None)
    if method == "compressed-tensors" and block.get("format") == "mxfp8-quantized":
        return Fp8Layout("_scale", (1, mxfp8.BLOCK), e8m0=True)
    raise CheckpointError(
        f"{where}: quant_method {method!r} (format {block.get('format')!r}) is not an FP8 layout this tool "
        "reads; expected 'fp8' or compressed-tensors 'float-quantized' / 'mxfp8-quantized' (INT4 checkpoints: convert_moe_int4_to_bf16)"
    )


def expected_scale_shape(
    weight: tuple[int, ...], layout: Fp8Layout, scale: tuple[int, ...]
) -> tuple[int, ...]:
    """The scale shape a weight needs; for per-row/per-tensor layouts, whichever of the two fits."""
    if layout.block_size is not None:
        bn, bk = layout.block_size
        return (*weight[:-2], math.ceil(weight[-2] / bn), math.ceil(weight[-1] / bk))
    if scale in ((1,), ()):
        return scale
    return (*weight[:-1], 1)


def pair_fp8_weights(tensors: dict[str, TensorInfo], layout: Fp8Layout) -> dict[str, str]:
    """weight name -> scale name for every e4m3 tensor, validated from headers alone."""
    pairs = {}
    for name, info in sorted(tensors.items()):
        if info.dtype != FP8_DTYPE:
            continue
        scale = name + layout.scale_suffix
        if scale not in tensors:
            raise CheckpointError(
                f"tensor {name!r} in {info.shard} is FP8 but its scale {scale!r} is in no shard; the checkpoint "
                "is corrupt (a weight without its scale is never kept as is) - re-download or re-convert it"
            )
        s = tensors[scale]
        if s.dtype != layout.scale_dtype:
            raise CheckpointError(f"scale {scale!r} in {s.shard} is {s.dtype}, expected {layout.scale_dtype}")
        want = expected_scale_shape(info.shape, layout, s.shape)
        if s.shape != want:
            raise CheckpointError(
                f"scale {scale!r} in {s.shard} has shape {list(s.shape)}, weight {name!r} {list(info.shape)} "
                f"needs {list(want)} (weight_block_size {layout.block_size}); config and tensors disagree"
            )
        pairs[name] = scale
    orphans = sorted(n for n in tensors if n.endswith(layout.scale_suffix) and n not in set(pairs.values()))
    if orphans:
        raise CheckpointError(
            f"scale {orphans[0]!r} in {tensors[orphans[0]].shard} has no FP8 weight "
            f"{orphans[0].removesuffix(layout.scale_suffix)!r}; the checkpoint is corrupt"
        )
    if not pairs:
        raise CheckpointError("no F8_E4M3 tensor in the checkpoint: nothing to dequantize")
    return pairs


def make_fp8_dequant_transform(
    source: ShardedCheckpoint, pairs: dict[str, str], layout: Fp8Layout
) -> ShardTransform:
    scales = set(pairs.values())

    def dequantize(q: torch.Tensor, scale: torch.Tensor, name: str) -> torch.Tensor:
        if layout.e8m0:  # every byte but 0xFF (refused there) is a valid power of two
            return dispatch.dequantize_mxfp8(q, scale, name=name)
        if not bool((scale > 0).all()):
            raise CheckpointError(f"scale of {name!r}: {int((scale <= 0).sum())} non-positive value(s)")
        if layout.block_size is not None:
            return dispatch.dequantize_fp8_blockwise(q, scale, block_size=layout.block_size, name=name)
        if scale.numel() == 1:
            return fp8_blockwise.dequantize_per_tensor(q, scale, name=name)
        return fp8_blockwise.dequantize_per_channel(q, scale, name=name)

    def convert(name: str, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        scale_name = pairs[name]
        # The index finds a scale that another shard holds.
        scale = tensors[scale_name] if scale_name in tensors else source.read_tensor(scale_name)
        scale = scale.to(tensors[name].device)  # a scale read from another shard is on the CPU
        if not torch.isfinite(scale).all():
            raise CheckpointError(f"scale {scale_name!r} in {source.tensors[scale_name].shard}: NaN or inf")
        return {name: dequantize(tensors[name], scale, name)}

    return tensorwise_transform(convert, converts=pairs, consumed=scales)


def strip_quantization_config(config: dict[str, Any]) -> dict[str, Any] | None:
    """Remove `quantization_config` (root, else `text_config`) in place; returns the removed block."""
    if "quantization_config" in config:
        return config.pop("quantization_config")
    text = text_config_of(config)
    return text.pop("quantization_config", None) if text is not config else None
