"""MXFP8: OCP MX e4m3 elements in 1 x 32 blocks along K, one E8M0 exponent per block.

The reference for FORMATS.md "MXFP8". The exponent uses TE's "round up" rule (also cuBLAS,
DeepGEMM, triton_kernels ROUND_UP), not the OCP floor rule and not torch's `float8_e8m0fnu`
cast: `e = ceil(log2(amax * fp32(1/448)))`, read from the float bits and clamped to [-127, 127].
Powers of two are built from bits, so `w * 2^-e` and the dequant multiply are exact scalings.
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
    check_no_e4m3_nan,
    check_shape,
)
from skyq.quant.fp8_blockwise import E4M3_MAX, abs_max, promotable, to_e4m3_

BLOCK = 32
E8M0_NAN = 0xFF
_HALF_MANTISSA = 0x400000  # mantissa bits of the fp32 subnormal 2^-127


def e8m0_exponent(amax: Tensor) -> Tensor:
    """Unbiased block exponent (int32) for a block max `amax >= 0`: TE's `float_to_e8m0` of
    `t = amax * fp32(1/448)`.

    `e` is `t`'s exponent plus one when its mantissa is non-zero, i.e. `ceil(log2(t))`, clamped
    to [-127, 127]. A zero block gets -127. Subnormal `t` (exponent field 0) rounds up to -126
    only above 2^-127.
    """
    check_finite(amax, "amax")
    amax = amax.float()
    t = amax * torch.full_like(amax, 1.0 / E4M3_MAX)
    bits = t.view(torch.int32)
    biased = (bits >> 23) & 0xFF
    mantissa = bits & 0x7FFFFF
    round_up = torch.where(biased == 0, mantissa > _HALF_MANTISSA, mantissa != 0)
    return (biased + round_up.to(torch.int32)).clamp(0, 254) - 127


def exp2(e: Tensor) -> Tensor:
    """Exact fp32 `2^e` for int32 `e` in [-127, 127] (2^-127 is the subnormal 0x00400000)."""
    normal = ((e + 127) << 23).view(torch.float32)
    return torch.where(e == -127, torch.full_like(normal, 2.0**-127), normal)


def _padded_k(k: int, allow_pad: bool, name: str) -> int:
    if k % BLOCK and not allow_pad:
        raise QuantizationError(
            f"{name}: MXFP8 needs K % {BLOCK} == 0, but K = {k} = {k // BLOCK} * {BLOCK} + {k % BLOCK}; "
            f"pad K to {math.ceil(k / BLOCK) * BLOCK} or leave this tensor unquantized"
        )
    return -k % BLOCK


def quantize(w: Tensor, *, name: str = "tensor", allow_pad: bool = False) -> tuple[Tensor, Tensor]:
    """Quantize `w` [..., N, K] (any float dtype, any strides) in 1 x 32 blocks along K.

    Returns `(q float8_e4m3fn [..., N, K], scale uint8 [..., N, ceil(K/32)])`, `scale = e + 127`.
    A K that is not a multiple of 32 is refused unless `allow_pad` (then the last block is
    zero padded for its max only).
    """
    x = promotable(w, name)
    k = x.shape[-1]
    pad = _padded_k(k, allow_pad, name)
    blocks = (F.pad(x, (0, pad)) if pad else x).unflatten(-1, (-1, BLOCK))
    amax = abs_max(blocks, -1)
    check_finite_reduced(amax, w, name)
    e = e8m0_exponent(amax)
    q = to_e4m3_((blocks * exp2(-e)[..., None]).flatten(-2)[..., :k]).contiguous()
    return q, (e + 127).to(torch.uint8)


def dequantize(
    q: Tensor, scale_u8: Tensor, *, dtype: torch.dtype = torch.bfloat16, name: str = "tensor"
) -> Tensor:
    """`q.float() * 2^(scale - 127)` in fp32 (exact), then cast to `dtype`.

    Refuses the E8M0 NaN byte 0xFF, NaN e4m3 codes and a scale shape that does not match `q`.
    """
    check_dtype(q, torch.float8_e4m3fn, name)
    check_dtype(scale_u8, torch.uint8, f"{name} weight_scale")
    if q.ndim < 2:
        raise QuantizationError(f"{name}: expected at least 2 dims ([..., N, K]), got shape {tuple(q.shape)}")
    k = q.shape[-1]
    expected = (*q.shape[:-1], math.ceil(k / BLOCK))
    check_shape(scale_u8, expected, f"{name} weight_scale", f"ceil({k}/{BLOCK}) blocks per row")
    n_nan = int((scale_u8 == E8M0_NAN).sum())
    if n_nan:
        raise QuantizationError(f"{name} weight_scale: {n_nan} E8M0 NaN byte(s) (0xFF)")
    check_no_e4m3_nan(q, name)
    return _dequantize(q, scale_u8, dtype)


def _dequantize(q: Tensor, scale_u8: Tensor, dtype: torch.dtype) -> Tensor:
    k = q.shape[-1]
    blocks = F.pad(q.float(), (0, -k % BLOCK)).unflatten(-1, (-1, BLOCK))
    scaled = blocks * exp2(scale_u8.to(torch.int32) - 127)[..., None]
    return scaled.flatten(-2)[..., :k].to(dtype).contiguous()
