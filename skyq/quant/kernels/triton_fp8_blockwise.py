"""Triton kernels for FP8 blockwise (FORMATS.md "FP8 blockwise"): quantize and dequantize.

One program owns one scale block (`bn x bk`, e.g. 128 x 128) or, for 1 x `bk` tiles
(activations), a band of rows: it reads the tile once, reduces its amax in registers and writes
the codes and the scale, so the tensor crosses HBM once (2 B read + 1 B written per bf16 element).

Bit-identity with `skyq.quant.fp8_blockwise` rests on three facts, each checked on the GPU:
`tl.math.div_rn` is IEEE round-to-nearest division (the reference divides tensor by tensor, never
multiplies by a reciprocal); fp32 products are correctly rounded; the e4m3 cast rounds to nearest
even, and the clamp to +-448 comes first, as in the reference.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor

from skyq.quant import fp8_blockwise
from skyq.quant.kernels._common import as_3d, cdiv, new_flag, raise_if_flagged
from skyq.quant.kernels._group import GroupTable, group_input, group_member, group_ok, group_tile

_FLT_MAX = tl.constexpr(3.4028234663852886e38)
_EXPONENT_BITS = tl.constexpr(0x7F800000)
ROW_TILE_ELEMENTS = 8192  # elements per program in 1 x bk mode: 16 KB of bf16 in flight


@triton.jit
def fp8_scale(amax, POW2: tl.constexpr):
    """TE `compute_scale_from_amax` on a block of amaxes: correctly rounded fp32 `448 / amax`,
    FLT_MAX when that overflows, 1 where `amax == 0`; POW2 clears the mantissa (rounds down)."""
    scale = tl.math.div_rn(tl.zeros_like(amax) + 448.0, amax)
    scale = tl.where(scale > _FLT_MAX, _FLT_MAX, scale)
    scale = tl.where(amax == 0.0, 1.0, scale)
    if POW2:
        scale = (scale.to(tl.int32, bitcast=True) & _EXPONENT_BITS).to(tl.float32, bitcast=True)
    return scale


@triton.jit
def to_e4m3(x):
    """Clamp first: the hardware cast saturates too, but the clamp keeps the reference's order."""
    return tl.clamp(x, -448.0, 448.0).to(tl.float8e4nv)


@triton.jit
def nonfinite_2d(ax):
    """[1, 1] int32: 1 when the tile of |x| holds NaN or inf (NaN fails every comparison)."""
    return tl.max(tl.max(tl.where(ax <= _FLT_MAX, 0, 1), axis=1, keep_dims=True), axis=0, keep_dims=True)


@triton.jit
def flag_if(bad, flag_ptr):
    if tl.max(tl.max(bad, axis=1), axis=0) > 0:
        tl.atomic_add(flag_ptr, 1)


@triton.jit
def _quant_kernel(
    x_ptr, q_ptr, s_ptr, s2_ptr, flag_ptr,
    N, K, n_tiles_k,
    sxb, sxn, sxk,
    ssb, ssn, ssk,
    s2b, s2k, s2n,
    TN: tl.constexpr, TK: tl.constexpr, SUB: tl.constexpr, ROWWISE: tl.constexpr, POW2: tl.constexpr,
    WRITE_S2: tl.constexpr, CHECK: tl.constexpr, FAKE: tl.constexpr = False,
):  # fmt: skip
    """x [B, N, K] (any strides) -> q [B, N, K] contiguous, scale_inv at `s_ptr` with strides
    (ssb, ssn, ssk) per (batch, block row, block col). ROWWISE: one scale per row of a TN x TK
    tile (1 x TK blocks); else one scale per TN x TK tile. WRITE_S2 writes a second copy of the scales with
    strides (s2b, s2k, s2n) per (batch, block col, block row) (the transposed GEMM scale layout).
    FAKE: fake quantization: q_ptr (of x's dtype) gets fp32(code) * scale_inv in its dtype (the
    dequantized value), no scales are written.

    A TN x TK block is held in registers whole when SUB == TN; with SUB < TN it is read in SUB-row
    slices twice (amax, then codes; the second read hits L2), which keeps registers low enough for
    several programs per SM to overlap their loads. HBM traffic is the same."""
    pid = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    pid_n = pid // n_tiles_k
    pid_k = pid % n_tiles_k
    rk = pid_k * TK + tl.arange(0, TK)
    k_ok = rk[None, :] < K
    x_base = x_ptr + b * sxb + rk[None, :] * sxk
    q_base = q_ptr + b * N * K + rk[None, :]
    if ROWWISE or SUB == TN:
        rn = pid_n.to(tl.int64) * TN + tl.arange(0, TN)
        mask = (rn[:, None] < N) & k_ok
        x = tl.load(x_base + rn[:, None] * sxn, mask=mask, other=0.0).to(tl.float32)
        ax = tl.abs(x)
        if CHECK:
            flag_if(nonfinite_2d(ax), flag_ptr)
        amax = tl.max(ax, axis=1, keep_dims=True)
        if not ROWWISE:
            amax = tl.max(amax, axis=0, keep_dims=True)
        scale = fp8_scale(amax, POW2)
        q = to_e4m3(x * scale)
        if FAKE:
            inv = tl.math.div_rn(tl.zeros_like(scale) + 1.0, scale)
            tl.store(q_base + rn[:, None] * K, (q.to(tl.float32) * inv).to(q_ptr.dtype.element_ty), mask=mask)
        else:
            tl.store(q_base + rn[:, None] * K, q, mask=mask)
            if ROWWISE:
                inv = tl.math.div_rn(tl.zeros_like(scale) + 1.0, scale)
                tl.store(s_ptr + b * ssb + rn[:, None] * ssn + pid_k * ssk, inv, mask=rn[:, None] < N)
    else:
        amax = tl.zeros([1, 1], dtype=tl.float32)
        bad = tl.zeros([1, 1], dtype=tl.int32)
        for i in range(TN // SUB):
            rn = pid_n.to(tl.int64) * TN + i * SUB + tl.arange(0, SUB)
            x = tl.load(x_base + rn[:, None] * sxn, mask=(rn[:, None] < N) & k_ok, other=0.0).to(tl.float32)
            ax = tl.abs(x)
            amax = tl.maximum(amax, tl.max(tl.max(ax, axis=1, keep_dims=True), axis=0, keep_dims=True))
            if CHECK:
                bad = tl.maximum(bad, nonfinite_2d(ax))
        if CHECK:
            flag_if(bad, flag_ptr)
        scale = fp8_scale(amax, POW2)
        inv = tl.math.div_rn(tl.zeros_like(scale) + 1.0, scale)
        for i in range(TN // SUB):
            rn = pid_n.to(tl.int64) * TN + i * SUB + tl.arange(0, SUB)
            mask = (rn[:, None] < N) & k_ok
            x = tl.load(x_base + rn[:, None] * sxn, mask=mask, other=0.0).to(tl.float32)
            q = to_e4m3(x * scale)
            if FAKE:
                q = (q.to(tl.float32) * inv).to(q_ptr.dtype.element_ty)
            tl.store(q_base + rn[:, None] * K, q, mask=mask)
    if not ROWWISE and not FAKE:
        inv = tl.math.div_rn(tl.zeros_like(scale) + 1.0, scale)
        zero = tl.zeros([1, 1], dtype=tl.int64)
        tl.store(s_ptr + b * ssb + pid_n * ssn + pid_k * ssk + zero, inv)
        if WRITE_S2:
            tl.store(s2_ptr + b * s2b + pid_k * s2k + pid_n * s2n + zero, inv)


@triton.jit
def _quant_group_kernel(
    tbl_ptr, flag_ptr, n_tensors,
    TN: tl.constexpr, TK: tl.constexpr, POW2: tl.constexpr, LOG: tl.constexpr, DT: tl.constexpr,
    ALIGNED: tl.constexpr,
):  # fmt: skip
    """`_quant_kernel` (whole TN x TK blocks in registers) over many tensors in one launch (rows as
    `_group` describes them): x [B, N, K] of dtype DT at any strides -> q [B, N, K] e4m3 and
    scale_inv [B, nN, nK] fp32, both contiguous; bumps `flag_ptr[t]` on a non-finite input.
    ALIGNED: rows load and store as 16-byte vectors (`GroupTable.aligned`)."""
    t, row, local = group_member(tbl_ptr, n_tensors, LOG)
    x_ptr = group_input(row, DT)
    q_ptr = tl.load(row + 1).to(tl.pointer_type(tl.float8e4nv))
    s_ptr = tl.load(row + 2).to(tl.pointer_type(tl.float32))
    k = tl.load(row + 4)
    n, sxb, sxn, sxk, tiles, b, tile, pid_n, pid_k = group_tile(row, local)
    rk = pid_k * TK + tl.arange(0, TK)
    rn = pid_n * TN + tl.arange(0, TN)
    mask = (rn[:, None] < n) & (rk[None, :] < k)
    if ALIGNED:
        x_ptr = tl.multiple_of(x_ptr, 16)
        q_ptr = tl.multiple_of(q_ptr, 16)
        k = tl.multiple_of(k, 16)
        mask = (rn[:, None] < n) & (rk[None, :] < k)
        if DT == 2:
            x_rows = tl.multiple_of(b * sxb + rn * sxn, 4)
        else:
            x_rows = tl.multiple_of(b * sxb + rn * sxn, 8)
        q_rows = tl.multiple_of(b * n * k + rn * k, 16)[:, None]
        x = tl.load(x_ptr + x_rows[:, None] + rk[None, :], mask=mask, other=0.0).to(tl.float32)
    else:
        q_rows = b * n * k + rn[:, None] * k
        x = tl.load(x_ptr + b * sxb + rn[:, None] * sxn + rk[None, :] * sxk, mask=mask, other=0.0).to(
            tl.float32
        )
    ax = tl.abs(x)
    flag_if(nonfinite_2d(ax), flag_ptr + t)
    amax = tl.max(tl.max(ax, axis=1, keep_dims=True), axis=0, keep_dims=True)
    scale = fp8_scale(amax, POW2)
    tl.store(q_ptr + q_rows + rk[None, :], to_e4m3(x * scale), mask=mask)
    inv = tl.math.div_rn(tl.zeros_like(scale) + 1.0, scale)
    tl.store(s_ptr + b * tiles + tile + tl.zeros([1, 1], dtype=tl.int64), inv)


@triton.jit
def _dequant_kernel(
    q_ptr, s_ptr, out_ptr, flag_ptr,
    N, K, n_tiles_k,
    sqb, sqn, sqk,
    ssb, ssn, ssk,
    BN: tl.constexpr, BK: tl.constexpr, TN: tl.constexpr, TK: tl.constexpr,
):  # fmt: skip
    """out[b, n, k] = q[b, n, k] * scale_inv[b, n // BN, k // BK] in fp32, cast to out's dtype.
    Counts NaN codes (0x7F/0xFF) and non-finite scales into `flag_ptr`."""
    pid = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    pid_n = pid // n_tiles_k
    pid_k = pid % n_tiles_k
    rn = pid_n.to(tl.int64) * TN + tl.arange(0, TN)
    rk = pid_k * TK + tl.arange(0, TK)
    mask = (rn[:, None] < N) & (rk[None, :] < K)
    q = tl.load(q_ptr + b * sqb + rn[:, None] * sqn + rk[None, :] * sqk, mask=mask, other=0.0)
    s = tl.load(s_ptr + b * ssb + (rn // BN)[:, None] * ssn + (rk // BK)[None, :] * ssk, mask=mask, other=1.0)
    nan_code = (q.to(tl.uint8, bitcast=True) & 0x7F) == 0x7F
    bad = tl.max(tl.max(tl.where(nan_code | ~(tl.abs(s) <= _FLT_MAX), 1, 0), axis=1), axis=0)
    if bad > 0:
        tl.atomic_add(flag_ptr, 1)
    out = q.to(tl.float32) * s
    tl.store(out_ptr + b * N * K + rn[:, None] * K + rk[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


def _pow2_at_most(v: int, limit: int) -> bool:
    return 0 < v <= limit and v & (v - 1) == 0


def supports(block_size: tuple[int, int]) -> bool:
    """Block shapes the quantize kernel tiles directly: powers of two with at most 128 x 128
    elements (the tile lives in registers). Anything else takes the reference path."""
    bn, bk = block_size
    return _pow2_at_most(bn, 256) and _pow2_at_most(bk, 1024) and bn * bk <= 16384


def quant_tile(bn: int, bk: int, rows: int | None = None) -> tuple[int, int, bool]:
    """(TN, TK, rowwise) for a block shape: one block per program, or a band of rows for 1 x bk
    (narrower for a tensor of few `rows`, see `SMALL_ROW_BANDS`)."""
    if bn == 1:
        return small_row_band(rows)[0] or max(1, ROW_TILE_ELEMENTS // bk), bk, True
    return bn, bk, False


SMALL_ROW_BANDS = ((16, 1, 1), (512, 4, 2))
"""(at most this many rows, rows a program, warps) for 1 x bk tiles of a small tensor (decode's
activations): its time is latency, not bandwidth, so narrow bands on few warps (the row amax then
stays within a warp) and more programs. Chosen from `benchmarks/quantizers.py --decode-sizes` (graphed
1 x 128 fake quantization at 1-256 rows; figures in docs/benchmarks.md), where these bands beat the wide
`ROW_TILE_ELEMENTS` band at every size."""


def small_row_band(rows: int | None) -> tuple[int, int]:
    """(TN, warps) of `SMALL_ROW_BANDS` for a tensor of `rows` rows; (0, 0) beyond them (or None)."""
    for limit, tn, warps in SMALL_ROW_BANDS:
        if rows is not None and rows <= limit:
            return tn, warps
    return 0, 0


def num_warps_for(elements: int) -> int:
    return 8 if elements >= 8192 else 4


# Square blocks: rows per slice and warps, tuned on the H200 (benchmarks/quantizers.py sweeps them).
BLOCK_SUB_ROWS = 128  # whole block in registers: 0.89 of copy vs 0.80 for 32-row slices
BLOCK_NUM_WARPS = 8


def sub_rows(tn: int, rowwise: bool, sub: int | None = None) -> int:
    return tn if rowwise else min(tn, sub or BLOCK_SUB_ROWS)


def launch_quantize(
    w: Tensor,
    *,
    block_size: tuple[int, int],
    pow2_scale: bool,
    num_warps: int | None = None,
    sub: int | None = None,
    fake: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    """One launch, no host sync: `(q [B, N, K], scale_inv [B, nN, nK], flag)`; flag > 0 means a
    non-finite input (the outputs are then meaningless). `num_warps`, `sub`: benchmark sweeps.
    `fake`: q is the dequantized value in w's dtype instead of the codes, and scale_inv is not
    written (fake quantization in one pass)."""
    bn, bk = block_size
    x = as_3d(w)
    nb, n, k = x.shape
    tn, tk, rowwise = quant_tile(bn, bk, n)
    q = torch.empty((nb, n, k), dtype=w.dtype if fake else torch.float8_e4m3fn, device=w.device)
    s = torch.empty((nb, cdiv(n, bn), cdiv(k, bk)), dtype=torch.float32, device=w.device)
    flag = new_flag(w.device)
    n_tiles_k = cdiv(k, tk)
    grid = (cdiv(n, tn) * n_tiles_k, nb)
    _quant_kernel[grid](
        x, q, s, s, flag,
        n, k, n_tiles_k,
        *x.stride(),
        *s.stride(),
        0, 0, 0,
        TN=tn, TK=tk, SUB=sub_rows(tn, rowwise, sub), ROWWISE=rowwise, POW2=pow2_scale,
        WRITE_S2=False, CHECK=True, FAKE=fake,
        num_warps=num_warps or (
            (small_row_band(n)[1] or num_warps_for(tn * tk)) if rowwise else BLOCK_NUM_WARPS
        ),
    )  # fmt: skip
    return q, s, flag


def quantize(
    w: Tensor, *, block_size: tuple[int, int] = (128, 128), pow2_scale: bool = False, name: str = "tensor"
) -> tuple[Tensor, Tensor]:
    """Same contract and bits as `fp8_blockwise.quantize` for a floating-point `w` [..., N, K]
    whose block shape passes `supports`. One kernel launch and one host sync (the finiteness
    flag)."""
    q, s, flag = launch_quantize(w, block_size=block_size, pow2_scale=pow2_scale)
    raise_if_flagged(flag, lambda: fp8_blockwise.quantize(w, block_size=block_size, name=name))
    return q.reshape(w.shape), s.reshape(*w.shape[:-2], *s.shape[-2:])


def fake_quantize(
    w: Tensor, *, block_size: tuple[int, int] = (128, 128), pow2_scale: bool = False, name: str = "tensor"
) -> Tensor:
    """`fp8_blockwise._dequantize(*fp8_blockwise.quantize(w, ...), w.dtype)`, the same bits, in one
    pass (read w, write its fake-quantized values): one launch; the finite check is the
    quantizer's (`raise_if_flagged`: deferred inside `dispatch.deferred_finite_checks`)."""
    y, _, flag = launch_quantize(w, block_size=block_size, pow2_scale=pow2_scale, fake=True)
    raise_if_flagged(flag, lambda: fp8_blockwise.quantize(w, block_size=block_size, name=name))
    return y.reshape(w.shape)


def group_supports(ws: list[Tensor], block_size: tuple[int, int]) -> bool:
    """Whether `launch_quantize_group` takes these tensors (`_group.group_ok`) with this block: one
    the whole-block path holds (bn > 1, at most 128 x 128)."""
    bn, _ = block_size
    return supports(block_size) and 1 < bn <= BLOCK_SUB_ROWS and group_ok(ws)


def launch_quantize_group(
    ws: list[Tensor],
    *,
    block_size: tuple[int, int],
    pow2_scale: bool,
    out: Sequence[tuple[Tensor, Tensor]] | None = None,
) -> tuple[list[Tensor], list[Tensor], Tensor]:
    """One launch for all of `ws` (`group_supports`), no host sync: `(q [B, N, K] per tensor,
    scale_inv [B, nN, nK] per tensor, flags int32 [len(ws)])`, the same bits as `launch_quantize`
    of each; flag t > 0 means a non-finite input in `ws[t]`. `out`: per tensor, contiguous (q,
    scale_inv) to write into instead (any shape of those element counts)."""
    bn, bk = block_size
    group = GroupTable(ws)
    qs, ss = [], []
    for i, w in enumerate(ws):
        nb, n, k = as_3d(w).shape
        n_tiles_n, n_tiles_k = cdiv(n, bn), cdiv(k, bk)
        qs.append(group.output(out, i, 0, (nb, n, k), torch.float8_e4m3fn))
        ss.append(group.output(out, i, 1, (nb, n_tiles_n, n_tiles_k), torch.float32))
        group.add(w, qs[-1], ss[-1], n_tiles_n * n_tiles_k, n_tiles_k)
    table, flags, log = group.args()
    _quant_group_kernel[(group.programs,)](
        table, flags, group.n,
        TN=bn, TK=bk, POW2=pow2_scale, LOG=log, DT=group.dtype_code, ALIGNED=group.aligned,
        num_warps=BLOCK_NUM_WARPS,
    )  # fmt: skip
    return qs, ss, flags


def _dequantize_args_ok(q: Tensor, scale_inv: Tensor, bn: int, bk: int) -> bool:
    if q.dtype != torch.float8_e4m3fn or scale_inv.dtype != torch.float32 or q.ndim < 2 or q.numel() == 0:
        return False
    n, k = q.shape[-2:]
    return tuple(scale_inv.shape) == (*q.shape[:-2], cdiv(n, bn), cdiv(k, bk))


def dequantize(
    q: Tensor,
    scale_inv: Tensor,
    *,
    block_size: tuple[int, int] = (128, 128),
    dtype: torch.dtype = torch.bfloat16,
    name: str = "tensor",
) -> Tensor:
    """Same contract and bits as `fp8_blockwise.dequantize`; any positive block shape.

    Dtypes and shapes are checked up front (cheap, no sync); a wrong one goes to the reference,
    which raises its own error. NaN codes and non-finite scales are detected inside the kernel,
    and then the reference's checks raise."""
    bn, bk = block_size
    if not _dequantize_args_ok(q, scale_inv, bn, bk):
        return fp8_blockwise.dequantize(q, scale_inv, block_size=block_size, dtype=dtype, name=name)
    q3, s3 = as_3d(q), as_3d(scale_inv)
    nb, n, k = q3.shape
    out = torch.empty((nb, n, k), dtype=dtype, device=q.device)
    flag = new_flag(q.device)
    tn, tk = 32, 128
    n_tiles_k = cdiv(k, tk)
    grid = (cdiv(n, tn) * n_tiles_k, nb)
    _dequant_kernel[grid](
        q3, s3, out, flag,
        n, k, n_tiles_k,
        *q3.stride(),
        *s3.stride(),
        BN=bn, BK=bk, TN=tn, TK=tk,
        num_warps=4,
    )  # fmt: skip
    raise_if_flagged(flag, lambda: fp8_blockwise.dequantize(q, scale_inv, block_size=block_size, name=name))
    return out.reshape(q.shape)
