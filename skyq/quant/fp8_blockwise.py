"""FP8 e4m3 with fp32 scales: DeepSeek-V3 blockwise layout, Transformer Engine's scale arithmetic.

The reference for FORMATS.md "FP8 blockwise": fake-quant, the weight push, the converters and any
kernel must match these functions bit for bit. Plain vectorized torch, identical on CPU and GPU.

Every division is tensor / tensor: torch computes `448 / t` (Python scalar over a tensor) as
`t.reciprocal() * 448`, and on CUDA `t / 7.0` as `t * (1 / 7.0)`, neither correctly rounded.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from skyq.quant.errors import (
    QuantizationError,
    check_dtype,
    check_finite,
    check_finite_reduced,
    check_float_input,
    check_no_e4m3_nan,
    check_shape,
)

E4M3_MAX = 448.0
FLT_MAX = torch.finfo(torch.float32).max
_FP32_EXPONENT_BITS = 0x7F800000


def to_e4m3(x: Tensor) -> Tensor:
    """Cast to float8_e4m3fn after clamping to [-448, 448] (torch casts 448..480 and inf to NaN)."""
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def to_e4m3_(x: Tensor) -> Tensor:
    """`to_e4m3` that clamps `x` (a temporary the caller owns) in place: one fp32 pass less."""
    return x.clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


# fp32 arithmetic on these dtypes (type promotion) equals fp32 arithmetic on `w.float()`: the
# conversion to fp32 is exact, so the quantizers skip the fp32 copy of the whole input.
EXACT_IN_FP32 = (torch.bfloat16, torch.float16, torch.float32)


def promotable(w: Tensor, name: str) -> Tensor:
    """`w` itself if its dtype widens to fp32 exactly inside torch ops, else `w.float()`."""
    check_float_input(w, name)
    return w if w.dtype in EXACT_IN_FP32 else w.float()


_MAGNITUDE_BITS = {
    torch.bfloat16: (torch.int16, 0x7FFF),
    torch.float16: (torch.int16, 0x7FFF),
    torch.float32: (torch.int32, 0x7FFFFFFF),
}


def abs_max(x: Tensor, dim: int | tuple[int, ...], *, keepdim: bool = False) -> Tensor:
    """`x.abs().amax(dim)` for a `promotable` tensor, in x's dtype, computed on the bit patterns.

    Clearing the sign bit gives |x|, and non-negative IEEE floats order like their bits as
    integers, so an integer max (faster than a float max on CPU; docs/benchmarks.md, M6 converters)
    picks the same element. NaN and inf have the largest magnitude bits, so a block holding one
    still gets a non-finite max.
    """
    int_dtype, mask = _MAGNITUDE_BITS[x.dtype]
    return (x.view(int_dtype) & mask).amax(dim=dim, keepdim=keepdim).view(x.dtype)


def scale_from_amax(amax: Tensor, *, pow2_scale: bool = False) -> Tensor:
    """TE `compute_scale_from_amax`: fp32 `448 / amax`, FLT_MAX on overflow, 1 where `amax == 0`.

    `pow2_scale` rounds the scale down to a power of two by clearing its mantissa bits (the scale
    is always a normal number: it is at least 448 / FLT_MAX).
    """
    amax = amax.float()
    scale = torch.full_like(amax, E4M3_MAX) / amax
    scale = torch.where(torch.isinf(scale), torch.full_like(scale, FLT_MAX), scale)
    scale = torch.where(amax == 0, torch.ones_like(scale), scale)
    if pow2_scale:
        scale = (scale.view(torch.int32) & _FP32_EXPONENT_BITS).view(torch.float32)
    return scale


def is_pow2(scale: Tensor) -> bool:
    """True when every element is a power of two in E8M0's range [2^-127, 2^127] (fp32 subnormal
    2^-127 included), i.e. the tensor can be written with `scale_fmt: ue8m0`."""
    s = scale.float()
    mantissa, exponent = torch.frexp(s)
    ok = torch.isfinite(s) & (s > 0) & (mantissa == 0.5) & (exponent - 1 >= -127)
    return bool(ok.all())


def _block_size(block_size: tuple[int, int] | list[int]) -> tuple[int, int]:
    if len(block_size) != 2 or not all(isinstance(b, int) and b > 0 for b in block_size):
        raise QuantizationError(f"block_size must be two positive ints (bn, bk), got {block_size!r}")
    return int(block_size[0]), int(block_size[1])


def _blocks(x: Tensor, bn: int, bk: int) -> Tensor:
    """[..., N, K] -> [..., ceil(N/bn), bn, ceil(K/bk), bk], edge blocks zero padded."""
    n, k = x.shape[-2:]
    if n % bn or k % bk:  # F.pad copies even when it pads nothing
        x = F.pad(x, (0, -k % bk, 0, -n % bn))
    return x.unflatten(-1, (-1, bk)).unflatten(-3, (-1, bn))


def _unblock(blocks: Tensor, n: int, k: int) -> Tensor:
    """Inverse of `_blocks`: crop the padding away."""
    return blocks.flatten(-2).flatten(-3, -2)[..., :n, :k]


def quantize(
    w: Tensor,
    *,
    block_size: tuple[int, int] = (128, 128),
    pow2_scale: bool = False,
    name: str = "tensor",
) -> tuple[Tensor, Tensor]:
    """Quantize `w` [..., N, K] (any float dtype, any strides) with one scale per `bn x bk` block.

    Blocks tile the last two dims (a 3-D expert stack gets per-expert blocks).
    Returns `(q, weight_scale_inv)`: `q` float8_e4m3fn [..., N, K] and `weight_scale_inv` fp32
    [..., ceil(N/bn), ceil(K/bk)], the dequant multiplier `1 / scale`.
    `pow2_scale` gives power-of-two scales (what `scale_fmt: ue8m0` promises).
    `name` is used in error messages.
    """
    bn, bk = _block_size(block_size)
    x = promotable(w, name)
    n, k = x.shape[-2:]
    blocks = _blocks(x, bn, bk)
    amax = abs_max(abs_max(blocks, -1), -2)  # [..., N/bn, bn, K/bk] then [..., N/bn, K/bk]
    check_finite_reduced(amax, w, name)
    scale = scale_from_amax(amax, pow2_scale=pow2_scale)
    q = to_e4m3_(_unblock(blocks * scale[..., :, None, :, None], n, k)).contiguous()
    return q, torch.ones_like(scale) / scale


def dequantize(
    q: Tensor,
    scale_inv: Tensor,
    *,
    block_size: tuple[int, int] = (128, 128),
    dtype: torch.dtype = torch.bfloat16,
    name: str = "tensor",
) -> Tensor:
    """`q.float() * scale_inv[i // bn, j // bk]` in fp32, then cast to `dtype`.

    Refuses NaN codes, non-finite scales and a `scale_inv` whose shape does not match `q`.
    """
    bn, bk = _block_size(block_size)
    check_dtype(q, torch.float8_e4m3fn, name)
    check_dtype(scale_inv, torch.float32, f"{name} weight_scale_inv")
    if q.ndim < 2:
        raise QuantizationError(f"{name}: expected at least 2 dims ([..., N, K]), got shape {tuple(q.shape)}")
    n, k = q.shape[-2:]
    expected = (*q.shape[:-2], math.ceil(n / bn), math.ceil(k / bk))
    check_shape(scale_inv, expected, f"{name} weight_scale_inv", f"ceil({n}/{bn}), ceil({k}/{bk}) blocks")
    check_finite(scale_inv, f"{name} weight_scale_inv")
    check_no_e4m3_nan(q, name)
    return _dequantize(q, scale_inv, bn, bk, dtype)


def _dequantize(q: Tensor, scale_inv: Tensor, bn: int, bk: int, dtype: torch.dtype) -> Tensor:
    n, k = q.shape[-2:]
    blocks = _blocks(q.float(), bn, bk) * scale_inv[..., :, None, :, None]
    return _unblock(blocks, n, k).to(dtype).contiguous()


def quantize_per_channel(w: Tensor, *, name: str = "tensor") -> tuple[Tensor, Tensor]:
    """One scale per row (compressed-tensors `channel`): `(q e4m3 [..., N, K], weight_scale fp32
    [..., N, 1])`, where `weight_scale = 1 / scale` is the dequant multiplier."""
    x = promotable(w, name)
    amax = abs_max(x, -1, keepdim=True)
    check_finite_reduced(amax, w, name)
    scale = scale_from_amax(amax)
    return to_e4m3_(x * scale), torch.ones_like(scale) / scale


def quantize_per_tensor(w: Tensor, *, name: str = "tensor") -> tuple[Tensor, Tensor]:
    """One scale for the whole tensor: `(q e4m3, weight_scale fp32 [1])`.

    The scale has shape [1], not [], because compressed-tensors registers a `tensor`-strategy
    `weight_scale` as `torch.empty((1,))` and engines load it with that shape.
    """
    x = promotable(w, name)
    amax = abs_max(x, tuple(range(x.ndim))).reshape(1)
    check_finite_reduced(amax, w, name)
    scale = scale_from_amax(amax)  # shape [1], not [], so `x * scale` promotes x to fp32
    return to_e4m3_(x * scale), torch.ones_like(scale) / scale


def dequantize_per_channel(
    q: Tensor, weight_scale: Tensor, dtype: torch.dtype = torch.bfloat16, *, name: str = "tensor"
) -> Tensor:
    """`q.float() * weight_scale` ([..., N, 1]) in fp32, then cast to `dtype`."""
    check_dtype(q, torch.float8_e4m3fn, name)
    check_dtype(weight_scale, torch.float32, f"{name} weight_scale")
    check_shape(weight_scale, (*q.shape[:-1], 1), f"{name} weight_scale", "one scale per row")
    check_finite(weight_scale, f"{name} weight_scale")
    check_no_e4m3_nan(q, name)
    return (q.float() * weight_scale).to(dtype)


def dequantize_per_tensor(
    q: Tensor, weight_scale: Tensor, dtype: torch.dtype = torch.bfloat16, *, name: str = "tensor"
) -> Tensor:
    """`q.float() * weight_scale` (one element, shape [1] or []) in fp32, then cast to `dtype`."""
    check_dtype(q, torch.float8_e4m3fn, name)
    check_dtype(weight_scale, torch.float32, f"{name} weight_scale")
    if weight_scale.numel() != 1 or weight_scale.ndim > 1:
        raise QuantizationError(
            f"{name} weight_scale: expected shape [1] or [], got {tuple(weight_scale.shape)}"
        )
    check_finite(weight_scale, f"{name} weight_scale")
    check_no_e4m3_nan(q, name)
    return (q.float() * weight_scale.reshape(())).to(dtype)


def quantize_activation(
    x: Tensor, *, tile: int = 128, pow2_scale: bool = False, name: str = "activation"
) -> tuple[Tensor, Tensor]:
    """Activations [..., M, K] in 1 x `tile` tiles along K, same scale rule as the weights.

    Returns `(q e4m3 [..., M, K], scale_inv fp32 [..., M, ceil(K/tile)])`.
    """
    return quantize(x, block_size=(1, tile), pow2_scale=pow2_scale, name=name)


def dequantize_activation(
    q: Tensor,
    scale_inv: Tensor,
    *,
    tile: int = 128,
    dtype: torch.dtype = torch.bfloat16,
    name: str = "activation",
) -> Tensor:
    """Inverse of `quantize_activation`."""
    return dequantize(q, scale_inv, block_size=(1, tile), dtype=dtype, name=name)
