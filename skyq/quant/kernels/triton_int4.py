"""Triton kernels for INT4 W4A16 (FORMATS.md "INT4 W4A16"): quantize + pack in one pass, and
unpack + dequantize.

A program loads [TN, TK/G, G] (one group per middle index), computes the bf16-rounded group
scale, the codes as the IEEE quotient rounded half-even (division-free, see the kernel), and
packs eight nibbles per int32 in registers: 2 B read, 0.5 B + scales written per element, no int8
intermediate in HBM.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor

from skyq.config.enums import Int4Grid
from skyq.quant import int4
from skyq.quant.kernels._common import as_3d, cdiv, new_flag, raise_if_flagged
from skyq.quant.kernels._group import GroupTable, group_input, group_member, group_ok, group_tile

_FLT_MAX = tl.constexpr(3.4028234663852886e38)
_AMAX_FLOOR = tl.constexpr(1e-10)  # the reference's fp32(1e-10)
# q + 1.5 * 2^23 rounds an fp32 |q| < 2^22 to an integer, ties to even (as torch.round), and that
# integer sits in the low mantissa bits: bits(q + magic) - bits(magic) is the int32 code, with no
# float-to-int conversion (a quarter-rate instruction) and no libdevice (the interpreter lacks it).
_ROUND_MAGIC = tl.constexpr(12582912.0)
_ROUND_MAGIC_BITS = tl.constexpr(0x4B400000)


@triton.jit
def _max_propagating_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _encode_groups(x, rn, rg, N, K, flag_ptr, scale_ptr, DIVISOR: tl.constexpr, QMIN: tl.constexpr,
                   QMAX: tl.constexpr, G: tl.constexpr):  # fmt: skip
    """x [TN, TK/G, G] fp32 (rows rn [TN, 1, 1], groups rg [1, TK/G, 1]) -> (scale [TN, TK/G, 1] in
    the scale pointer's dtype, code + 8 int32 [TN, TK/G, G] in [0, 15]); stores 1 at `flag_ptr`
    when a group holds NaN or inf (the group amax propagates NaN, so the finiteness check costs no
    extra pass).

    The quotient fl(x / s) is the reference's IEEE division, computed per element with one
    multiply and two FMAs instead of a division: with r = fl(1 / s) (one division per group) and
    q0 = fl(x * r) (within 1 ulp of x / s), rem = x - q0 * s is exact in an FMA and
    fl(q0 + rem * r) is the correctly rounded x / s (Markstein's theorem; no operand here is
    subnormal where it matters: |x / s| <= 8.5 and s >= 1e-10 / 7.5)."""
    amax_or_nan = tl.reduce(tl.abs(x), 2, _max_propagating_nan, keep_dims=True)
    group_ok = (rn < N) & (rg < K // G)
    bad = group_ok & ~(amax_or_nan <= _FLT_MAX)
    tl.store(flag_ptr + tl.zeros(amax_or_nan.shape, dtype=tl.int32), 1, mask=bad)
    amax = tl.maximum(amax_or_nan, _AMAX_FLOOR)
    scale = tl.math.div_rn(amax, tl.zeros_like(amax) + DIVISOR).to(scale_ptr.dtype.element_ty)
    s = scale.to(tl.float32)
    r = tl.math.div_rn(tl.zeros_like(s) + 1.0, s)
    q0 = x * r
    q = tl.fma(tl.fma(-q0, s, x), r, q0)
    z = tl.clamp(q, QMIN, QMAX) + _ROUND_MAGIC  # clamp then round == round then clamp: integer bounds
    return scale, z.to(tl.int32, bitcast=True) - (_ROUND_MAGIC_BITS - 8)  # code + 8, in [0, 15]


@triton.jit
def _pack_words(biased, TN: tl.constexpr, TK: tl.constexpr):
    """Codes + 8 [TN, TK/G, G] -> [TN, TK/8] int32, eight nibbles per word, lowest first."""
    nibbles = tl.reshape(biased, (TN, TK // 8, 8))
    return tl.sum(nibbles << (tl.arange(0, 8) * 4)[None, None, :], axis=2)


@triton.jit
def _quant_pack_kernel(
    x_ptr, packed_ptr, codes_ptr, scale_ptr, flag_ptr,
    N, K, n_tiles_k,
    sxb, sxn, sxk,
    DIVISOR: tl.constexpr, QMIN: tl.constexpr, QMAX: tl.constexpr,
    G: tl.constexpr, TN: tl.constexpr, TK: tl.constexpr,
    WRITE_PACKED: tl.constexpr, WRITE_CODES: tl.constexpr,
):  # fmt: skip
    """x [B, N, K] (K % G == 0) -> packed int32 [B, N, K/8] and/or codes int8 [B, N, K], and
    scale [B, N, K/G] in the scale pointer's dtype (bf16). Sets flag[0] = 1 when a group holds
    NaN or inf (`_encode_groups`)."""
    pid = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    pid_n = pid // n_tiles_k
    pid_k = pid % n_tiles_k
    rn = (pid_n.to(tl.int64) * TN + tl.arange(0, TN))[:, None, None]
    rg = (pid_k * (TK // G) + tl.arange(0, TK // G))[None, :, None]
    rk = rg * G + tl.arange(0, G)[None, None, :]
    mask = (rn < N) & (rk < K)
    x = tl.load(x_ptr + b * sxb + rn * sxn + rk * sxk, mask=mask, other=0.0).to(tl.float32)
    scale, biased = _encode_groups(x, rn, rg, N, K, flag_ptr, scale_ptr, DIVISOR, QMIN, QMAX, G)
    n_groups = K // G
    tl.store(scale_ptr + b * N * n_groups + rn * n_groups + rg, scale, mask=(rn < N) & (rg < n_groups))
    if WRITE_CODES:
        tl.store(codes_ptr + b * N * K + rn * K + rk, (biased - 8).to(tl.int8), mask=mask)
    if WRITE_PACKED:
        words = _pack_words(biased, TN, TK)
        rw = (pid_k * (TK // 8) + tl.arange(0, TK // 8))[None, :]
        rn2 = pid_n.to(tl.int64) * TN + tl.arange(0, TN)[:, None]
        tl.store(packed_ptr + b * N * (K // 8) + rn2 * (K // 8) + rw, words, mask=(rn2 < N) & (rw < K // 8))


@triton.jit
def _quant_pack_group_kernel(
    tbl_ptr, flag_ptr, n_tensors,
    DIVISOR: tl.constexpr, QMIN: tl.constexpr, QMAX: tl.constexpr,
    G: tl.constexpr, TN: tl.constexpr, TK: tl.constexpr, LOG: tl.constexpr, DT: tl.constexpr,
    ALIGNED: tl.constexpr,
):  # fmt: skip
    """`_quant_pack_kernel` (packed output only) over many tensors in one launch (rows as `_group`
    describes them, the q column the packed words'): x [B, N, K] of dtype DT at any strides ->
    packed int32 [B, N, K/8] and scale bf16 [B, N, K/G], both contiguous; sets `flag_ptr[t]` on a
    non-finite input. ALIGNED: x rows load as 16-byte vectors (`GroupTable.aligned`)."""
    t, row, local = group_member(tbl_ptr, n_tensors, LOG)
    x_ptr = group_input(row, DT)
    p_ptr = tl.load(row + 1).to(tl.pointer_type(tl.int32))
    s_ptr = tl.load(row + 2).to(tl.pointer_type(tl.bfloat16))
    k = tl.load(row + 4)
    n, sxb, sxn, sxk, _, b, _, pid_n, pid_k = group_tile(row, local)
    rn1 = pid_n * TN + tl.arange(0, TN)
    rn = rn1[:, None, None]
    rg = (pid_k * (TK // G) + tl.arange(0, TK // G))[None, :, None]
    rk = rg * G + tl.arange(0, G)[None, None, :]
    if ALIGNED:
        x_ptr = tl.multiple_of(x_ptr, 16)
        k = tl.multiple_of(k, 16)
        if DT == 2:
            x_rows = tl.multiple_of(b * sxb + rn1 * sxn, 4)
        else:
            x_rows = tl.multiple_of(b * sxb + rn1 * sxn, 8)
        mask = (rn < n) & (rk < k)
        x = tl.load(x_ptr + x_rows[:, None, None] + rk, mask=mask, other=0.0).to(tl.float32)
    else:
        mask = (rn < n) & (rk < k)
        x = tl.load(x_ptr + b * sxb + rn * sxn + rk * sxk, mask=mask, other=0.0).to(tl.float32)
    scale, biased = _encode_groups(x, rn, rg, n, k, flag_ptr + t, s_ptr, DIVISOR, QMIN, QMAX, G)
    n_groups = k // G
    tl.store(s_ptr + b * n * n_groups + rn * n_groups + rg, scale, mask=(rn < n) & (rg < n_groups))
    words = _pack_words(biased, TN, TK)
    rw = (pid_k * (TK // 8) + tl.arange(0, TK // 8))[None, :]
    rn2 = rn1[:, None]
    tl.store(p_ptr + b * n * (k // 8) + rn2 * (k // 8) + rw, words, mask=(rn2 < n) & (rw < k // 8))


@triton.jit
def _unpack_dequant_kernel(
    packed_ptr, scale_ptr, out_ptr,
    N, K, n_tiles_k,
    G: tl.constexpr, TN: tl.constexpr, TK: tl.constexpr,
):  # fmt: skip
    """out = (q * scale) rounded to the scale's dtype, then cast to out's dtype, where q are the
    nibbles of packed [B, N, K/8] minus 8 (K % G == 0, G % 8 == 0); all inputs contiguous."""
    pid = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    pid_n = pid // n_tiles_k
    pid_k = pid % n_tiles_k
    rn = (pid_n.to(tl.int64) * TN + tl.arange(0, TN))[:, None, None]
    rw = (pid_k * (TK // 8) + tl.arange(0, TK // 8))[None, :, None]
    mask_w = (rn < N) & (rw < K // 8)
    words = tl.load(packed_ptr + b * N * (K // 8) + rn * (K // 8) + rw, mask=mask_w, other=0)
    q = ((words >> (tl.arange(0, 8) * 4)[None, None, :]) & 0xF) - 8
    rk = rw * 8 + tl.arange(0, 8)[None, None, :]
    mask = (rn < N) & (rk < K)
    n_groups = K // G
    s = tl.load(scale_ptr + b * N * n_groups + rn * n_groups + rk // G, mask=mask, other=0.0)
    deq = (q.to(tl.float32) * s.to(tl.float32)).to(scale_ptr.dtype.element_ty)
    tl.store(out_ptr + b * N * K + rn * K + rk, deq.to(out_ptr.dtype.element_ty), mask=mask)


def _tile_k(group_size: int) -> int:
    return group_size * max(1, 256 // group_size)


def supports(group_size: int) -> bool:
    """Group sizes the kernels tile: powers of two from 8 to 1024."""
    return isinstance(group_size, int) and 8 <= group_size <= 1024 and group_size & (group_size - 1) == 0


def launch_quantize(
    w: Tensor,
    *,
    group_size: int,
    grid: Int4Grid | str,
    codes: bool,
    packed: bool,
    num_warps: int = 4,
    tile_elements: int = 4096,
) -> tuple[Tensor | None, Tensor | None, Tensor, Tensor]:
    """One launch, no host sync: `(codes [B, N, K] | None, packed [B, N, K/8] | None,
    scale [B, N, K/G], flag)`."""
    divisor, qmin, qmax = int4.GRIDS[Int4Grid(grid)]
    x = as_3d(w)
    nb, n, k = x.shape
    codes_out = torch.empty((nb, n, k), dtype=torch.int8, device=w.device) if codes else None
    packed_out = torch.empty((nb, n, k // 8), dtype=torch.int32, device=w.device) if packed else None
    scale = torch.empty((nb, n, k // group_size), dtype=torch.bfloat16, device=w.device)
    flag = new_flag(w.device)
    tk = _tile_k(group_size)
    tn = max(1, tile_elements // tk)
    n_tiles_k = cdiv(k, tk)
    _quant_pack_kernel[(cdiv(n, tn) * n_tiles_k, nb)](
        x, scale if packed_out is None else packed_out, scale if codes_out is None else codes_out, scale, flag,
        n, k, n_tiles_k,
        *x.stride(),
        DIVISOR=divisor, QMIN=qmin, QMAX=qmax, G=group_size, TN=tn, TK=tk,
        WRITE_PACKED=packed, WRITE_CODES=codes,
        num_warps=num_warps,
    )  # fmt: skip
    return codes_out, packed_out, scale, flag


def group_supports(ws: list[Tensor], group_size: int) -> bool:
    """Whether `launch_quantize_group` takes these tensors (`_group.group_ok`, a supported group
    size dividing every K)."""
    return supports(group_size) and group_ok(ws) and all(w.shape[-1] % group_size == 0 for w in ws)


def launch_quantize_group(
    ws: list[Tensor],
    *,
    group_size: int,
    grid: Int4Grid | str,
    out: Sequence[tuple[Tensor, Tensor]] | None = None,
    num_warps: int = 4,
    tile_elements: int = 4096,
) -> tuple[list[Tensor], list[Tensor], Tensor]:
    """One launch for all of `ws` (`group_supports`), no host sync: `(packed int32 [B, N, K/8] per
    tensor, scale bf16 [B, N, K/G] per tensor, flags int32 [len(ws)])`, the same bits as
    `launch_quantize(..., packed=True)` of each. `out`: per tensor, contiguous (packed, scale) to
    write into instead."""
    divisor, qmin, qmax = int4.GRIDS[Int4Grid(grid)]
    tk = _tile_k(group_size)
    tn = max(1, tile_elements // tk)
    group = GroupTable(ws)
    packs, scales = [], []
    for i, w in enumerate(ws):
        nb, n, k = as_3d(w).shape
        n_tiles_k = cdiv(k, tk)
        packs.append(group.output(out, i, 0, (nb, n, k // 8), torch.int32))
        scales.append(group.output(out, i, 1, (nb, n, k // group_size), torch.bfloat16))
        group.add(w, packs[-1], scales[-1], cdiv(n, tn) * n_tiles_k, n_tiles_k)
    table, flags, log = group.args()
    _quant_pack_group_kernel[(group.programs,)](
        table, flags, group.n,
        DIVISOR=divisor, QMIN=qmin, QMAX=qmax, G=group_size, TN=tn, TK=tk,
        LOG=log, DT=group.dtype_code, ALIGNED=group.aligned, num_warps=num_warps,
    )  # fmt: skip
    return packs, scales, flags


def quantize(
    w: Tensor,
    *,
    group_size: int,
    grid: Int4Grid | str = Int4Grid.kimi,
    name: str = "tensor",
    codes: bool = True,
    packed: bool = False,
) -> tuple[Tensor | None, Tensor | None, Tensor]:
    """`(codes int8 | None, packed int32 | None, scale bf16)` with the bits of `int4.quantize`
    and `int4.pack`; `codes`/`packed` select which outputs are written."""
    codes_out, packed_out, scale, flag = launch_quantize(
        w, group_size=group_size, grid=grid, codes=codes, packed=packed
    )
    raise_if_flagged(flag, lambda: int4.quantize(w, group_size=group_size, grid=grid, name=name))
    lead = w.shape[:-1]
    k = w.shape[-1]
    return (
        None if codes_out is None else codes_out.reshape(w.shape),
        None if packed_out is None else packed_out.reshape(*lead, k // 8),
        scale.reshape(*lead, k // group_size),
    )


def dequantize_packed(
    packed: Tensor, scale: Tensor, n: int, k: int, group_size: int, dtype: torch.dtype
) -> Tensor:
    """Dense [..., N, K] from validated `pack-quantized` tensors (the dispatcher checks shapes)."""
    p3, s3 = as_3d(packed).contiguous(), as_3d(scale).contiguous()
    if scale.dtype == torch.bfloat16 and dtype == torch.bfloat16 and group_size % 8 == 0:
        from skyq.quant.kernels import triton_int4_dequant

        return triton_int4_dequant.dequantize(p3, s3, n, k, group_size).reshape(*packed.shape[:-1], k)
    nb = p3.shape[0]
    out = torch.empty((nb, n, k), dtype=dtype, device=packed.device)
    tk = _tile_k(group_size)
    tn = max(1, 8192 // tk)
    n_tiles_k = cdiv(k, tk)
    _unpack_dequant_kernel[(cdiv(n, tn) * n_tiles_k, nb)](
        p3, s3, out, n, k, n_tiles_k, G=group_size, TN=tn, TK=tk, num_warps=8
    )
    return out.reshape(*packed.shape[:-1], k)
