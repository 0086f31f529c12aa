"""INT4 W4A16: symmetric groups of G along K, compressed-tensors `pack-quantized` layout.

The reference for FORMATS.md "INT4 W4A16". The scale is rounded to bf16 BEFORE the codes are
computed, so the training STE and the served checkpoint see the same grid bit for bit (an fp32
scale STE differs on ~5% of dequantized elements). Two real grids: `kimi` (/7, codes [-7, 7])
and `rtn` (/7.5, codes [-8, 7]). Packing: nibble `q + 8`, element 0 in the lowest bits of an
int32 (two's complement), 8 codes per word.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from skyq.config.enums import Int4Grid
from skyq.quant.errors import (
    QuantizationError,
    check_dtype,
    check_finite,
    check_finite_reduced,
    check_float_input,
    check_shape,
)
from skyq.quant.fp8_blockwise import abs_max, promotable

GRIDS: dict[Int4Grid, tuple[float, int, int]] = {
    Int4Grid.kimi: (7.0, -7, 7),  # (divisor, qmin, qmax)
    Int4Grid.rtn: (7.5, -8, 7),
}
AMAX_FLOOR = 1e-10
CODES_PER_WORD = 8
_SHIFTS = tuple(range(0, 32, 4))


def _grid(grid: Int4Grid | str) -> tuple[float, int, int]:
    try:
        return GRIDS[Int4Grid(grid)]
    except ValueError:
        raise QuantizationError(
            f"unknown INT4 grid {grid!r}; expected one of {[g.value for g in Int4Grid]}"
        ) from None


def _check_groups(k: int, group_size: int, name: str) -> None:
    if not isinstance(group_size, int) or group_size <= 0:
        raise QuantizationError(f"{name}: group_size must be a positive int, got {group_size!r}")
    if k % group_size:
        raise QuantizationError(
            f"{name}: INT4 needs K % group_size == 0, but K = {k} = {k // group_size} * {group_size} + "
            f"{k % group_size}"
        )


def _check_codes(q: Tensor, name: str) -> None:
    check_dtype(q, torch.int8, name)
    n_bad = int(((q < -8) | (q > 7)).sum())
    if n_bad:
        raise QuantizationError(f"{name}: {n_bad} code(s) outside the int4 range [-8, 7]")


def quantize(
    w: Tensor, *, group_size: int, grid: Int4Grid | str = Int4Grid.kimi, name: str = "tensor"
) -> tuple[Tensor, Tensor]:
    """Quantize `w` [..., N, K] (any float dtype, any strides) in groups of `group_size` along K.

    `scale = bf16(max(amax, 1e-10) / divisor)`, then `q = clamp(round_half_even(w / scale), qmin,
    qmax)` in fp32. Returns `(q int8 [..., N, K], scale bf16 [..., N, K / group_size])`.
    """
    q, scale = _quantize(w, group_size, grid, name)
    return q.to(torch.int8).flatten(-2), scale.squeeze(-1)


def quantize_packed(
    w: Tensor, *, group_size: int, grid: Int4Grid | str = Int4Grid.kimi, name: str = "tensor"
) -> tuple[Tensor, Tensor]:
    """`(pack(q), scale)` of `(q, scale) = quantize(w, ...)`, bit for bit, without the int8 codes'
    range check (they come from the clamp) and with the nibbles made straight from the fp32 codes.

    Returns `(weight_packed int32 [..., N, K / 8], weight_scale bf16 [..., N, K / group_size])`.
    """
    codes, scale = _quantize(w, group_size, grid, name)
    if w.shape[-1] % CODES_PER_WORD:
        k = w.shape[-1]
        raise QuantizationError(f"{name}: packing needs K % 8 == 0, got K = {k} = {k // 8} * 8 + {k % 8}")
    nibbles = (
        codes.add_(8).to(torch.int8).view(torch.uint8).flatten(-2)
    )  # fp32 -> int8 is vectorized, -> uint8 is not
    return _pack_nibbles(nibbles), scale.squeeze(-1)


def _quantize(w: Tensor, group_size: int, grid: Int4Grid | str, name: str) -> tuple[Tensor, Tensor]:
    """fp32 codes `[..., N, K / G, G]` (integers in [qmin, qmax]) and bf16 scales `[..., N, K / G, 1]`."""
    divisor, qmin, qmax = _grid(grid)
    x = promotable(w, name)
    _check_groups(x.shape[-1], group_size, name)
    groups = x.unflatten(-1, (-1, group_size))
    amax = abs_max(groups, -1, keepdim=True).float()
    check_finite_reduced(amax, w, name)
    scale = (torch.maximum(amax, torch.full_like(amax, AMAX_FLOOR)) / torch.full_like(amax, divisor)).to(
        torch.bfloat16
    )
    codes = groups / scale.float()  # a fresh fp32 temporary: round and clamp in place
    return codes.round_().clamp_(qmin, qmax), scale


def dequantize(
    q: Tensor, scale: Tensor, *, group_size: int, dtype: torch.dtype = torch.bfloat16, name: str = "tensor"
) -> Tensor:
    """`q * scale` computed in the scale's dtype (bf16 for skyq), then cast to `dtype`.

    This is compressed-tensors' own arithmetic (`x_q.to(scale.dtype) * scale`), so a checkpoint
    with fp16/fp32 scales dequantizes as it does there.
    """
    _check_codes(q, name)
    _check_scale(scale, q.shape, group_size, name)
    return _dequantize(q, scale, group_size, dtype)


def _dequantize(q: Tensor, scale: Tensor, group_size: int, dtype: torch.dtype) -> Tensor:
    groups = q.unflatten(-1, (-1, group_size)).to(scale.dtype) * scale[..., None]
    return groups.flatten(-2).to(dtype)


def _check_scale(scale: Tensor, q_shape: torch.Size, group_size: int, name: str) -> None:
    if len(q_shape) < 2:
        raise QuantizationError(f"{name}: expected at least 2 dims ([..., N, K]), got shape {tuple(q_shape)}")
    k = q_shape[-1]
    _check_groups(k, group_size, name)
    if not scale.is_floating_point():
        raise QuantizationError(f"{name} weight_scale: expected a floating-point tensor, got {scale.dtype}")
    expected = (*q_shape[:-1], k // group_size)
    check_shape(scale, expected, f"{name} weight_scale", f"{k} / {group_size} groups per row")
    check_finite(scale, f"{name} weight_scale")


def _pack_words(q: Tensor) -> Tensor:
    """Codes [..., M] -> int32 [..., ceil(M/8)]; a short last word is padded with nibble 0, as
    compressed-tensors does."""
    nibbles = (q + 8).view(torch.uint8)  # q in [-8, 7]: q + 8 in [0, 15] fits int8
    return _pack_nibbles(F.pad(nibbles, (0, -q.shape[-1] % CODES_PER_WORD)))


def _pack_nibbles(u: Tensor) -> Tensor:
    """uint8 nibbles [..., M] (M % 8 == 0) -> int32 [..., M/8], element 0 in the lowest bits.

    Two nibbles make a byte (`u[2i] | u[2i+1] << 4`), and 4 consecutive bytes read as a
    little-endian int32 are exactly `sum_j u[8m+j] << 4j` in two's complement: uint8 work, no
    int64 temporaries. Big-endian hosts take the int32 shift-and-or path.
    """
    if sys.byteorder == "little":
        pairs = u.contiguous().unflatten(-1, (-1, 2))
        return (pairs[..., 0] | (pairs[..., 1] << 4)).contiguous().view(torch.int32)
    words = u.unflatten(-1, (-1, CODES_PER_WORD)).to(torch.int32)
    out = words[..., 0].clone()
    for j, shift in enumerate(_SHIFTS[1:], start=1):
        out |= words[..., j] << shift  # int32 wraparound at shift 28 is the two's complement we want
    return out


def _unpack_words(packed: Tensor, m: int) -> Tensor:
    words = packed.to(torch.int64) & 0xFFFFFFFF
    nibbles = (words[..., None] >> torch.tensor(_SHIFTS, dtype=torch.int64, device=packed.device)) & 0xF
    return (nibbles - 8).to(torch.int8).flatten(-2)[..., :m].contiguous()


def pack(q: Tensor, *, name: str = "tensor") -> Tensor:
    """int8 codes [..., N, K] in [-8, 7] -> `weight_packed` int32 [..., N, K/8].

    `weight_packed[n, m] = sum_j (q[n, 8m + j] + 8) << 4j` as a two's-complement int32.
    """
    _check_codes(q, name)
    if q.ndim < 2 or q.shape[-1] % CODES_PER_WORD:
        raise QuantizationError(
            f"{name}: packing needs [..., N, K] with K % 8 == 0, got shape {tuple(q.shape)}"
            + (f" (K = {q.shape[-1]} = {q.shape[-1] // 8} * 8 + {q.shape[-1] % 8})" if q.ndim else "")
        )
    return _pack_words(q)


def unpack(packed: Tensor, k: int, *, name: str = "tensor") -> Tensor:
    """`weight_packed` int32 [..., N, ceil(k/8)] -> int8 codes [..., N, k]."""
    check_dtype(packed, torch.int32, f"{name} weight_packed")
    if packed.ndim < 1 or packed.shape[-1] != math.ceil(k / CODES_PER_WORD):
        raise QuantizationError(
            f"{name} weight_packed: K = {k} needs ceil({k}/8) = {math.ceil(k / 8)} words per row, "
            f"got shape {tuple(packed.shape)}"
        )
    return _unpack_words(packed, k)


def pack_zero_point(zero_point: Tensor, *, name: str = "tensor") -> Tensor:
    """Signed zero points [..., N, K/G] -> int32 [..., ceil(N/8), K/G], packed along N
    (compressed-tensors `pack_to_int32(zp, 4, packed_dim=0)`). For test/compat inputs only."""
    _check_codes(zero_point, f"{name} weight_zero_point")
    return _pack_words(zero_point.transpose(-1, -2)).transpose(-1, -2).contiguous()


def weight_shape_tensor(n: int, k: int) -> Tensor:
    """`X.weight_shape`: int64 [2] = [N, K], as compressed-tensors writes it."""
    return torch.tensor([n, k], dtype=torch.int64)


def _read_weight_shape(weight_shape: Tensor | Sequence[int], name: str) -> tuple[int, int]:
    values = weight_shape.tolist() if isinstance(weight_shape, Tensor) else list(weight_shape)
    if len(values) != 2 or not all(isinstance(v, int) and v > 0 for v in values):
        raise QuantizationError(f"{name} weight_shape: expected [N, K] of two positive ints, got {values!r}")
    return values[0], values[1]


def _infer_group_size(k: int, scale: Tensor, name: str) -> int:
    n_groups = scale.shape[-1] if scale.ndim else 0
    if n_groups == 0 or k % n_groups:
        raise QuantizationError(
            f"{name} weight_scale: cannot infer the group size, K = {k} is not a multiple of the "
            f"{n_groups} scale columns (shape {tuple(scale.shape)})"
        )
    return k // n_groups


def _unpack_checked(packed: Tensor, n: int, k: int, name: str) -> Tensor:
    if packed.ndim < 2 or packed.shape[-2] != n:
        raise QuantizationError(
            f"{name} weight_packed: weight_shape says N = {n} rows, got shape {tuple(packed.shape)}"
        )
    return unpack(packed, k, name=name)


def dequantize_packed(
    packed: Tensor,
    scale: Tensor,
    weight_shape: Tensor | Sequence[int],
    *,
    group_size: int | None = None,
    dtype: torch.dtype = torch.bfloat16,
    name: str = "tensor",
) -> Tensor:
    """A symmetric `pack-quantized` tensor -> dense [..., N, K]. `group_size` defaults to
    `K / scale.shape[-1]` (so channel-strategy scales [N, 1] work too)."""
    n, k = _read_weight_shape(weight_shape, name)
    if group_size is None:
        group_size = _infer_group_size(k, scale, name)
    q = _unpack_checked(packed, n, k, name)
    return dequantize(q, scale, group_size=group_size, dtype=dtype, name=name)


def dequantize_asymmetric(
    packed: Tensor,
    scale: Tensor,
    zero_point_packed: Tensor,
    weight_shape: Tensor | Sequence[int],
    *,
    dtype: torch.dtype = torch.bfloat16,
    name: str = "tensor",
) -> Tensor:
    """An asymmetric `pack-quantized` tensor -> dense [..., N, K].

    Zero points are compressed-tensors' layout: int32 [..., ceil(N/8), K/G], `zp + 8` packed
    along N. Arithmetic as compressed-tensors: `(q.to(s.dtype) - zp.to(s.dtype)) * s`.
    """
    n, k = _read_weight_shape(weight_shape, name)
    group_size = _infer_group_size(k, scale, name)
    q = _unpack_checked(packed, n, k, name)
    _check_scale(scale, q.shape, group_size, name)
    check_dtype(zero_point_packed, torch.int32, f"{name} weight_zero_point")
    expected = (*scale.shape[:-2], math.ceil(n / CODES_PER_WORD), scale.shape[-1])
    check_shape(zero_point_packed, expected, f"{name} weight_zero_point", f"ceil({n}/8) packed rows")
    zp = _unpack_words(zero_point_packed.transpose(-1, -2), n).transpose(-1, -2)
    groups = q.unflatten(-1, (-1, group_size)).to(scale.dtype) - zp.to(scale.dtype)[..., None]
    return (groups * scale[..., None]).flatten(-2).to(dtype)


def quantize_asymmetric(w: Tensor, *, group_size: int, name: str = "tensor") -> tuple[Tensor, Tensor, Tensor]:
    """Asymmetric int4 groups, for generating test and compatibility inputs only: skyq reads
    asymmetric checkpoints but never writes them for QAT.

    compressed-tensors' min/max rule with the range forced to include 0: `scale = bf16(max(max -
    min, 1e-10) / 15)`, `zp = clamp(round(-8 - min / scale), -8, 7)`, `q = clamp(round(w / scale +
    zp), -8, 7)`, in fp32. Returns signed `(q int8 [..., N, K], scale bf16 [..., N, K/G],
    zero_point int8 [..., N, K/G])`; the stored nibbles are `q + 8` and `zp + 8`.
    """
    check_float_input(w, name)
    x = w.float()
    check_finite(x, name)
    _check_groups(x.shape[-1], group_size, name)
    groups = x.unflatten(-1, (-1, group_size))
    lo = groups.amin(dim=-1, keepdim=True).clamp(max=0)
    hi = groups.amax(dim=-1, keepdim=True).clamp(min=0)
    span = torch.maximum(hi - lo, torch.full_like(hi, AMAX_FLOOR))
    scale = (span / torch.full_like(span, 15.0)).to(torch.bfloat16)
    _check_asymmetric_range(scale, lo, hi, group_size, name)
    zp = torch.round(-8 - lo / scale.float()).clamp(-8, 7)
    q = torch.round(groups / scale.float() + zp).clamp(-8, 7).to(torch.int8)
    return q.flatten(-2), scale.squeeze(-1), zp.squeeze(-1).to(torch.int8)


_BF16_MAX = torch.finfo(torch.bfloat16).max


def _check_asymmetric_range(scale: Tensor, lo: Tensor, hi: Tensor, group_size: int, name: str) -> None:
    """Refuse groups whose range the asymmetric grid cannot hold: `max - min` overflowing fp32 makes
    the scale inf, and any `15 * scale` past bf16's max makes dequantized codes (`(q - zp) * scale`,
    |q - zp| <= 15, in bf16) inf. Checked before any code is computed, so nothing inf is returned."""
    bad = ~(scale.float() * 15 <= _BF16_MAX)
    if bool(bad.any()):
        at = tuple(int(i) for i in bad.nonzero()[0])  # (..., row, group, 0)
        where = ", ".join(map(str, at[:-2])) + f", {at[-2] * group_size}:{(at[-2] + 1) * group_size}"
        raise QuantizationError(
            f"{name}[{where}]: asymmetric INT4 range max - min = {float(hi[at]):.4g} - ({float(lo[at]):.4g}) "
            f"gives scale {float(scale[at]):.4g}, whose codes overflow bf16 ({int(bad.sum())} group(s)); "
            "values this large are not trained weights - check the checkpoint, or quantize symmetric "
            "(the default)"
        )
