"""Triton kernels for MXFP8 (FORMATS.md "MXFP8"): quantize and dequantize, one HBM pass each.

A program loads a [TN, TK/32, 32] tile (each 1 x 32 block on its own last axis), takes the block
max, derives TE's round-up E8M0 exponent from the fp32 bits exactly as `skyq.quant.mxfp8` does,
and scales by a power of two built from bits, so `w * 2^-e` is exact and matches the reference.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor

from skyq.quant import mxfp8
from skyq.quant.kernels._common import as_3d, cdiv, new_flag, raise_if_flagged
from skyq.quant.kernels._group import GroupTable, group_input, group_member, group_ok, group_tile
from skyq.quant.kernels.triton_fp8_blockwise import to_e4m3

_FLT_MAX = tl.constexpr(3.4028234663852886e38)
_INV_448 = tl.constexpr(1.0 / 448.0)  # exactly the fp32 constant the reference multiplies by
_HALF_MANTISSA = tl.constexpr(0x400000)
_SUBNORMAL_2_POW_M127 = tl.constexpr(0x400000)  # fp32 bits of 2^-127
BLOCK = 32


@triton.jit
def pow2_from_biased(u):
    """Exact fp32 2^(u - 127) for int32 u in [0, 254]; u = 0 gives the subnormal 2^-127."""
    bits = tl.where(u == 0, _SUBNORMAL_2_POW_M127, u << 23)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def encode_blocks(x, flag_ptr):
    """(e4m3 codes, biased E8M0 exponents u) of a [TN, TG, 32] fp32 tile of 1 x 32 blocks, as the
    reference: TE's round-up exponent of amax / 448 from the fp32 bits, codes x * 2^(127 - u) (a
    power of two built from bits, so exact); bumps `flag_ptr` when the tile holds NaN or inf."""
    ax = tl.abs(x)
    bad = tl.max(tl.max(tl.max(tl.where(ax <= _FLT_MAX, 0, 1), axis=2), axis=1), axis=0)
    if bad > 0:
        tl.atomic_add(flag_ptr, 1)
    t = tl.max(ax, axis=2, keep_dims=True) * _INV_448
    bits = t.to(tl.int32, bitcast=True)
    biased = (bits >> 23) & 0xFF
    mantissa = bits & 0x7FFFFF
    round_up = tl.where(biased == 0, mantissa > _HALF_MANTISSA, mantissa != 0)
    u = tl.minimum(biased + round_up.to(tl.int32), 254)
    return to_e4m3(x * pow2_from_biased(254 - u)), u


@triton.jit
def _quant_kernel(
    x_ptr, q_ptr, s_ptr, flag_ptr,
    N, K, KB, n_tiles_k,
    sxb, sxn, sxk,
    TN: tl.constexpr, TG: tl.constexpr, FAKE: tl.constexpr = False,
):  # fmt: skip
    """x [B, N, K] -> q [B, N, K] e4m3, scale [B, N, KB] uint8 (KB = ceil(K/32)); a tile is TN
    rows x TG blocks of 32. FAKE: q_ptr gets q * 2^(u - 127) in q_ptr's dtype instead (the
    reference's `_dequantize`: the fp32 product, exact, cast once), s_ptr is not written."""
    pid = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    pid_n = pid // n_tiles_k
    pid_k = pid % n_tiles_k
    rn = (pid_n.to(tl.int64) * TN + tl.arange(0, TN))[:, None, None]
    rg = (pid_k * TG + tl.arange(0, TG))[None, :, None]
    rk = rg * 32 + tl.arange(0, 32)[None, None, :]
    mask = (rn < N) & (rk < K)
    x = tl.load(x_ptr + b * sxb + rn * sxn + rk * sxk, mask=mask, other=0.0).to(tl.float32)
    q, u = encode_blocks(x, flag_ptr)
    if FAKE:
        y = q.to(tl.float32) * pow2_from_biased(u)
        tl.store(q_ptr + b * N * K + rn * K + rk, y.to(q_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(q_ptr + b * N * K + rn * K + rk, q, mask=mask)
        tl.store(s_ptr + b * N * KB + rn * KB + rg, u.to(tl.uint8), mask=(rn < N) & (rg < KB))


@triton.jit
def _quant_group_kernel(
    tbl_ptr, flag_ptr, n_tensors,
    TN: tl.constexpr, TG: tl.constexpr, LOG: tl.constexpr, DT: tl.constexpr, ALIGNED: tl.constexpr,
):  # fmt: skip
    """`_quant_kernel` over many tensors in one launch (rows as `_group` describes them): x [B, N,
    K] of dtype DT at any strides -> q [B, N, K] e4m3 and scale [B, N, K/32] uint8, both
    contiguous; bumps `flag_ptr[t]` on a non-finite input. ALIGNED: rows move as 16-byte vectors
    (`GroupTable.aligned`; K is a multiple of 32)."""
    t, row, local = group_member(tbl_ptr, n_tensors, LOG)
    x_ptr = group_input(row, DT)
    q_ptr = tl.load(row + 1).to(tl.pointer_type(tl.float8e4nv))
    s_ptr = tl.load(row + 2).to(tl.pointer_type(tl.uint8))
    k = tl.load(row + 4)
    kb = k // 32
    n, sxb, sxn, sxk, _, b, _, pid_n, pid_k = group_tile(row, local)
    rn1 = pid_n * TN + tl.arange(0, TN)
    rn = rn1[:, None, None]
    rg = (pid_k * TG + tl.arange(0, TG))[None, :, None]
    rk = rg * 32 + tl.arange(0, 32)[None, None, :]
    if ALIGNED:
        x_ptr = tl.multiple_of(x_ptr, 16)
        q_ptr = tl.multiple_of(q_ptr, 16)
        k = tl.multiple_of(k, 32)
        if DT == 2:
            x_rows = tl.multiple_of(b * sxb + rn1 * sxn, 4)
        else:
            x_rows = tl.multiple_of(b * sxb + rn1 * sxn, 8)
        q_rows = tl.multiple_of(b * n * k + rn1 * k, 16)[:, None, None]
        mask = (rn < n) & (rk < k)
        x = tl.load(x_ptr + x_rows[:, None, None] + rk, mask=mask, other=0.0).to(tl.float32)
    else:
        q_rows = b * n * k + rn * k
        mask = (rn < n) & (rk < k)
        x = tl.load(x_ptr + b * sxb + rn * sxn + rk * sxk, mask=mask, other=0.0).to(tl.float32)
    q, u = encode_blocks(x, flag_ptr + t)
    tl.store(q_ptr + q_rows + rk, q, mask=mask)
    tl.store(s_ptr + b * n * kb + rn * kb + rg, u.to(tl.uint8), mask=(rn < n) & (rg < kb))


@triton.jit
def _dequant_kernel(
    q_ptr, s_ptr, out_ptr, flag_ptr,
    N, K, KB, n_tiles_k,
    TN: tl.constexpr, TG: tl.constexpr,
):  # fmt: skip
    """out = q * 2^(scale - 127) in fp32 (exact), cast to out's dtype; q and scale contiguous.
    Counts NaN codes and E8M0 NaN bytes (0xFF) into `flag_ptr`."""
    pid = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    pid_n = pid // n_tiles_k
    pid_k = pid % n_tiles_k
    rn = (pid_n.to(tl.int64) * TN + tl.arange(0, TN))[:, None, None]
    rg = (pid_k * TG + tl.arange(0, TG))[None, :, None]
    rk = rg * 32 + tl.arange(0, 32)[None, None, :]
    mask = (rn < N) & (rk < K)
    smask = (rn < N) & (rg < KB)
    q = tl.load(q_ptr + b * N * K + rn * K + rk, mask=mask, other=0.0)
    u = tl.load(s_ptr + b * N * KB + rn * KB + rg, mask=smask, other=127).to(tl.int32)
    nan_code = (q.to(tl.uint8, bitcast=True) & 0x7F) == 0x7F
    bad = tl.max(tl.max(tl.max(tl.where(nan_code | (u == 0xFF), 1, 0), axis=2), axis=1), axis=0)
    if bad > 0:
        tl.atomic_add(flag_ptr, 1)
    out = q.to(tl.float32) * pow2_from_biased(u)
    tl.store(out_ptr + b * N * K + rn * K + rk, out.to(out_ptr.dtype.element_ty), mask=mask)


_TN, _TG = 16, 16  # 16 rows x 512 columns per program: 16 KB of bf16 read


def launch_quantize(w: Tensor, *, num_warps: int = 4) -> tuple[Tensor, Tensor, Tensor]:
    """One launch, no host sync: `(q [B, N, K], scale [B, N, ceil(K/32)], flag)`."""
    x = as_3d(w)
    nb, n, k = x.shape
    kb = cdiv(k, BLOCK)
    q = torch.empty((nb, n, k), dtype=torch.float8_e4m3fn, device=w.device)
    s = torch.empty((nb, n, kb), dtype=torch.uint8, device=w.device)
    flag = new_flag(w.device)
    n_tiles_k = cdiv(kb, _TG)
    grid = (cdiv(n, _TN) * n_tiles_k, nb)
    _quant_kernel[grid](x, q, s, flag, n, k, kb, n_tiles_k, *x.stride(), TN=_TN, TG=_TG, num_warps=num_warps)
    return q, s, flag


def group_supports(ws: list[Tensor]) -> bool:
    """Whether `launch_quantize_group` takes these tensors (`_group.group_ok`, K a multiple of 32:
    no padding)."""
    return group_ok(ws) and all(w.shape[-1] % BLOCK == 0 for w in ws)


def launch_quantize_group(
    ws: list[Tensor], *, num_warps: int = 4, out: Sequence[tuple[Tensor, Tensor]] | None = None
) -> tuple[list[Tensor], list[Tensor], Tensor]:
    """One launch for all of `ws` (`group_supports`), no host sync: `(q [B, N, K] per tensor, scale
    [B, N, K/32] per tensor, flags int32 [len(ws)])`, the same bits as `launch_quantize` of each.
    `out`: per tensor, contiguous (q, scale) to write into instead."""
    group = GroupTable(ws)
    qs, ss = [], []
    for i, w in enumerate(ws):
        nb, n, k = as_3d(w).shape
        n_tiles_k = cdiv(k // BLOCK, _TG)
        qs.append(group.output(out, i, 0, (nb, n, k), torch.float8_e4m3fn))
        ss.append(group.output(out, i, 1, (nb, n, k // BLOCK), torch.uint8))
        group.add(w, qs[-1], ss[-1], cdiv(n, _TN) * n_tiles_k, n_tiles_k)
    table, flags, log = group.args()
    _quant_group_kernel[(group.programs,)](
        table, flags, group.n,
        TN=_TN, TG=_TG, LOG=log, DT=group.dtype_code, ALIGNED=group.aligned, num_warps=num_warps,
    )  # fmt: skip
    return qs, ss, flags


def quantize(w: Tensor, *, name: str = "tensor", allow_pad: bool = False) -> tuple[Tensor, Tensor]:
    """Same contract and bits as `mxfp8.quantize` for a floating-point `w` [..., N, K]."""
    k = w.shape[-1]
    if k % BLOCK and not allow_pad:
        return mxfp8.quantize(w, name=name, allow_pad=allow_pad)  # raises, with the arithmetic
    q, s, flag = launch_quantize(w)
    raise_if_flagged(flag, lambda: mxfp8.quantize(w, name=name, allow_pad=allow_pad))
    return q.reshape(w.shape), s.reshape(*w.shape[:-1], s.shape[-1])


def fake_quantize(w: Tensor, *, name: str = "tensor") -> Tensor:
    """`mxfp8._dequantize(*mxfp8.quantize(w), w.dtype)`, the same bits, in one pass (read w, write
    its fake-quantized values; K a multiple of 32, else the reference raises): one launch, the
    finite check the quantizer's (`raise_if_flagged`: deferred inside
    `dispatch.deferred_finite_checks`)."""
    k = w.shape[-1]
    if k % BLOCK:
        return mxfp8._dequantize(*mxfp8.quantize(w, name=name), w.dtype)  # raises, with the arithmetic
    x = as_3d(w)
    nb, n, _ = x.shape
    y = torch.empty((nb, n, k), dtype=w.dtype, device=w.device)
    flag = new_flag(w.device)
    kb = k // BLOCK
    n_tiles_k = cdiv(kb, _TG)
    _quant_kernel[(cdiv(n, _TN) * n_tiles_k, nb)](
        x, y, y, flag, n, k, kb, n_tiles_k, *x.stride(), TN=_TN, TG=_TG, FAKE=True, num_warps=4
    )  # fmt: skip
    raise_if_flagged(flag, lambda: mxfp8.quantize(w, name=name))
    return y.reshape(w.shape)


def dequantize(
    q: Tensor, scale_u8: Tensor, *, dtype: torch.dtype = torch.bfloat16, name: str = "tensor"
) -> Tensor:
    """Same contract and bits as `mxfp8.dequantize`. Wrong dtypes or shapes go to the reference,
    which raises; NaN codes and 0xFF scale bytes are detected in the kernel."""
    ok = q.dtype == torch.float8_e4m3fn and scale_u8.dtype == torch.uint8 and q.ndim >= 2 and q.numel() > 0
    if not ok or tuple(scale_u8.shape) != (*q.shape[:-1], cdiv(q.shape[-1], BLOCK)):
        return mxfp8.dequantize(q, scale_u8, dtype=dtype, name=name)
    q3, s3 = as_3d(q).contiguous(), as_3d(scale_u8).contiguous()
    nb, n, k = q3.shape
    kb = s3.shape[-1]
    out = torch.empty((nb, n, k), dtype=dtype, device=q.device)
    flag = new_flag(q.device)
    n_tiles_k = cdiv(kb, _TG)
    grid = (cdiv(n, _TN) * n_tiles_k, nb)
    _dequant_kernel[grid](q3, s3, out, flag, n, k, kb, n_tiles_k, TN=_TN, TG=_TG, num_warps=8)
    raise_if_flagged(flag, lambda: mxfp8.dequantize(q, scale_u8, dtype=dtype, name=name))
    return out.reshape(q.shape)
