"""Triton kernels that build the FP8 blockwise GEMM operands of a linear layer, in the exact
memory layouts cuBLAS's blockwise `scaled_mm` wants, so no transpose, pad or copy runs between
the quantizer and the GEMM.

The training recipe (DeepSeek-V3 / TE blockwise) needs each activation twice: in 1 x 128 tiles
along K (forward / dgrad operand) and in 1 x 128 tiles along M, transposed (wgrad operand).
`quantize_rows_cols` reads the tensor once and writes both (2 B read, 2 B written per bf16
element), the fused pass that makes FP8 training pay. Weights get their 128 x 128 codes in both
orientations with the scales already padded to a multiple of 4 blocks along K (cuBLAS reads
garbage otherwise: unpadded K = 768 scales gave silently wrong products on the H200).

Scale layouts (all fp32 dequant multipliers, shapes as cuBLAS checks them):
- rows of x [M, K]:    codes [Mp, K], scales [Mp, ceil(K/128)], strides (1, Mp)
- cols of x, as xT:    codes [K, Mp], scales [K, Mp/128], strides (1, K)
(Mp = M rounded up to 128; padding rows are codes 0 with scale 1: cuBLAS refused some ragged M.)
- weight w [N, K]:     [round4(ceil(K/128)), ceil(N/128)], strides (1, round4(...))
- weight, transposed:  [round4(ceil(N/128)), ceil(K/128)], strides (1, round4(...))
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from skyq.quant.kernels._common import as_3d, cdiv
from skyq.quant.kernels.triton_fp8_blockwise import (
    BLOCK_NUM_WARPS,
    BLOCK_SUB_ROWS,
    _quant_kernel,
    fp8_scale,
    num_warps_for,
    to_e4m3,
)

TILE = 128
ROW_BAND = 64  # rows per program in the rows-only kernel: 64 x 128 bf16 = 16 KB in flight
# Rows per slice and warps of the two-orientation kernel, tuned on the H200 (the benchmarks sweep them).
# H200 sweep (benchmarks/quantizers.py --no-compile --rounds 2, 2026-11-30): the whole 128 x 128 tile per
# load (SUB = 128) at 4 warps 0.649 of copy, 8 warps 0.560, 16 warps 0.308; sliced sweeps 4 warps x 16 rows
# 0.47, 8 x 16 0.30, 8 x 32 0.37. (Until the kernel stopped specializing M, 4 warps was wrong for M = 1.)
ROWS_COLS_SUB = 128
ROWS_COLS_NUM_WARPS = 4


@triton.jit(do_not_specialize=["M", "n_tiles_k"])
def _rows_cols_kernel(
    x_ptr, q_ptr, s_ptr, qt_ptr, st_ptr,
    M, K, MP, n_tiles_k,
    sxm, sxk,
    POW2: tl.constexpr, T: tl.constexpr, SUB: tl.constexpr,
):  # fmt: skip
    """One T x T tile of x [M, K]: row scales (1 x T along K) -> q [MP, K] and s_buf [nK, MP];
    column scales (1 x T along M) -> qt [K, MP] (transposed) and st_buf [MP / T, K]; rows M..MP-1
    read as 0. The rows sweep reads [SUB, T] row slices; the columns sweep re-reads the tile (from
    L2) as [T, SUB] column slices, which hold whole columns, so each slice has its own column amax
    and its transposed codes go out as full T-byte rows of qt. SUB == T loads the whole tile once
    and derives both orientations from those registers. (Accumulating the column amax in
    the rows sweep and writing SUB-byte pieces of qt rows was measured slower; docs/benchmarks.md, M1.)
    M and n_tiles_k are never specialized: with Triton 3.6 a launch where both are 1 (one 1 x 128
    input), specialized as constants, wrote wrong row codes on the H200 at 4 and 16 warps (and an
    explicit-layout Gluon version of this kernel at 8 and 16); as runtime values every warp count
    matched the reference (docs/benchmarks.md, M3)."""
    pid = tl.program_id(0)
    pid_m = pid // n_tiles_k
    pid_k = pid % n_tiles_k
    m0 = pid_m.to(tl.int64) * T
    k0 = (pid_k * T).to(tl.int64)
    rk = k0 + tl.arange(0, T)
    col_ok = rk[None, :] < K
    if SUB == T:
        # whole tile in one load (32 KB of bf16 in flight per program): both orientations from
        # the same registers, no second read from L2
        rm = m0 + tl.arange(0, T)
        x = tl.load(x_ptr + rm[:, None] * sxm + rk[None, :] * sxk, mask=(rm[:, None] < M) & col_ok, other=0.0)
        x = x.to(tl.float32)
        ax = tl.abs(x)
        row_scale = fp8_scale(tl.max(ax, axis=1, keep_dims=True), POW2)
        tl.store(q_ptr + rm[:, None] * K + rk[None, :], to_e4m3(x * row_scale), mask=col_ok)
        tl.store(s_ptr + pid_k * MP + rm[:, None], tl.math.div_rn(tl.zeros_like(row_scale) + 1.0, row_scale))
        cs = fp8_scale(tl.max(ax, axis=0, keep_dims=True), POW2)
        tl.store(st_ptr + pid_m * K + rk[None, :], tl.math.div_rn(tl.zeros_like(cs) + 1.0, cs), mask=col_ok)
        qc = to_e4m3(tl.trans(x * cs))
        tl.store(qt_ptr + rk[:, None] * MP + rm[None, :], qc, mask=tl.trans(col_ok))
        return
    for i in range(T // SUB):
        rm = m0 + i * SUB + tl.arange(0, SUB)
        x = tl.load(x_ptr + rm[:, None] * sxm + rk[None, :] * sxk, mask=(rm[:, None] < M) & col_ok, other=0.0)
        x = x.to(tl.float32)
        row_scale = fp8_scale(tl.max(tl.abs(x), axis=1, keep_dims=True), POW2)
        pad_ok = rm[:, None] < MP
        tl.store(q_ptr + rm[:, None] * K + rk[None, :], to_e4m3(x * row_scale), mask=pad_ok & col_ok)
        row_inv = tl.math.div_rn(tl.zeros_like(row_scale) + 1.0, row_scale)
        tl.store(s_ptr + pid_k * MP + rm[:, None], row_inv, mask=pad_ok)
    rm = m0 + tl.arange(0, T)
    for j in range(T // SUB):
        rc = k0 + j * SUB + tl.arange(0, SUB)
        c_ok = rc[None, :] < K
        x = tl.load(x_ptr + rm[:, None] * sxm + rc[None, :] * sxk, mask=(rm[:, None] < M) & c_ok, other=0.0)
        x = x.to(tl.float32)
        cs = fp8_scale(tl.max(tl.abs(x), axis=0, keep_dims=True), POW2)
        tl.store(st_ptr + pid_m * K + rc[None, :], tl.math.div_rn(tl.zeros_like(cs) + 1.0, cs), mask=c_ok)
        # transpose in fp32, then cast (this order gave the reference's bits on the H200)
        qc = to_e4m3(tl.trans(x * cs))
        tl.store(qt_ptr + rc[:, None] * MP + rm[None, :], qc, mask=tl.trans(c_ok & (rm[:, None] < MP)))


def round_up(v: int, m: int) -> int:
    return cdiv(v, m) * m


def quantize_rows(x: Tensor, *, pow2_scale: bool = False) -> tuple[Tensor, Tensor]:
    """x [M, K] (any strides) -> (q e4m3 [Mp, K], scale [Mp, ceil(K/128)] with strides (1, Mp)).
    No finiteness check: in training a non-finite activation propagates, as it would in bf16."""
    m, k = x.shape
    mp = round_up(m, TILE)
    q = torch.empty((mp, k), dtype=torch.float8_e4m3fn, device=x.device)
    s_buf = torch.empty((cdiv(k, TILE), mp), dtype=torch.float32, device=x.device)
    if mp > m:
        q[m:].view(torch.uint8).zero_()
        s_buf[:, m:].fill_(1.0)
    n_tiles_k = cdiv(k, TILE)
    _quant_kernel[(cdiv(m, ROW_BAND) * n_tiles_k, 1)](
        x, q, s_buf, s_buf, s_buf,
        m, k, n_tiles_k,
        0, *x.stride(),
        0, 1, mp,
        0, 0, 0,
        TN=ROW_BAND, TK=TILE, SUB=ROW_BAND, ROWWISE=True, POW2=pow2_scale, WRITE_S2=False, CHECK=False,
        num_warps=num_warps_for(ROW_BAND * TILE),
    )  # fmt: skip
    return q, s_buf.t()


def quantize_rows_cols(
    x: Tensor,
    *,
    pow2_scale: bool = False,
    sub: int | None = None,
    num_warps: int | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """x [M, K] (any strides) -> (q [Mp, K], scale [Mp, ceil(K/128)] strides (1, Mp),
    qt [K, Mp], scale_t [K, Mp/128] strides (1, K)) in one pass."""
    sub, num_warps = sub or ROWS_COLS_SUB, num_warps or ROWS_COLS_NUM_WARPS
    m, k = x.shape
    mp = round_up(m, TILE)
    q = torch.empty((mp, k), dtype=torch.float8_e4m3fn, device=x.device)
    s_buf = torch.empty((cdiv(k, TILE), mp), dtype=torch.float32, device=x.device)
    qt = torch.empty((k, mp), dtype=torch.float8_e4m3fn, device=x.device)
    st_buf = torch.empty((mp // TILE, k), dtype=torch.float32, device=x.device)
    n_tiles_k = cdiv(k, TILE)
    _rows_cols_kernel[(cdiv(m, TILE) * n_tiles_k,)](
        x, q, s_buf, qt, st_buf, m, k, mp, n_tiles_k, *x.stride(),
        POW2=pow2_scale, T=TILE, SUB=sub,
        num_warps=num_warps,
    )  # fmt: skip
    return q, s_buf.t(), qt, st_buf.t()


def quantize_weight(w: Tensor, *, pow2_scale: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """w [..., N, K] -> (q [..., N, K], scale_fwd [..., round4(nK), nN], qt [..., K, N],
    scale_bwd [..., round4(nN), nK]) with 128 x 128 blocks; the codes and scale values are those
    of `fp8_blockwise.quantize(w)`, the padding scales are 1. The transposed codes are a torch
    copy (1 B read + 1 B written per element, once per optimizer step): an in-kernel fp8 tile
    transpose gave wrong bytes on the H200 with Triton 3.6."""
    x = as_3d(w)
    nb, n, k = x.shape
    nn_, nk = cdiv(n, TILE), cdiv(k, TILE)
    l4k, l4n = round_up(nk, 4), round_up(nn_, 4)
    q = torch.empty((nb, n, k), dtype=torch.float8_e4m3fn, device=w.device)
    s_fwd = torch.ones((nb, nn_, l4k), dtype=torch.float32, device=w.device)
    s_bwd = torch.ones((nb, nk, l4n), dtype=torch.float32, device=w.device)
    _quant_kernel[(nn_ * nk, nb)](
        x, q, s_fwd, s_bwd, s_fwd,
        n, k, nk,
        *x.stride(),
        *s_fwd.stride(),
        *s_bwd.stride(),
        TN=TILE, TK=TILE, SUB=BLOCK_SUB_ROWS, ROWWISE=False, POW2=pow2_scale, WRITE_S2=True, CHECK=False,
        num_warps=BLOCK_NUM_WARPS,
    )  # fmt: skip
    lead = w.shape[:-2]
    qt = q.view(torch.uint8).transpose(-1, -2).contiguous().view(torch.float8_e4m3fn)
    return (
        q.reshape(w.shape),
        s_fwd.transpose(-1, -2).reshape(*lead, l4k, nn_),
        qt.reshape(*lead, k, n),
        s_bwd.transpose(-1, -2).reshape(*lead, l4n, nk),
    )
