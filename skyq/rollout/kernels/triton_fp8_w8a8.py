"""Triton FP8 x FP8 linear on the FP8 tensor cores, for the engine's large decode steps: y = dequant(xq,
xs) @ dequant(q, s)^T from e4m3 codes on both sides, dense or grouped (MoE experts).

The engine's FP8 recipes quantize every linear's input anyway (1 x 128 tiles along K: the trainer's
W8A8 numerics), so the activation codes and their scales exist before the GEMM. Past ~16 rows an
expert the weight-only kernel (`gluon_fp8_gemv`, which converts every weight code to bf16 once per
row tile) is slower than bf16's grouped GEMM (docs/benchmarks.md), while a step of an RL
rollout decodes hundreds of rows: 512 tokens over Qwen3-30B-A3B's 128 experts, top-8, are 32 rows an
expert. Here each 128-column K step is one MMA of e4m3 x e4m3 -> fp32 whose partial sum is scaled by
the weight block's scale and each row's activation scale and added in fp32 (DeepSeek-V3's blockwise
recipe: partial sums promoted to fp32 every 128 columns): no code is converted, and the weight is
read once a row tile at 1 byte an element.

Swap-AB (as `triton_fp8_gemv`): a BN-row weight tile is the MMA's first operand and BM activation
rows (16 to 128) its second, so a few rows an expert waste no weight bytes. Program (n, e, j) takes N
tile n of expert e's weight (e = 0 for a dense weight) and that expert's row tiles j, j + MT, j +
2 MT, ...; an expert without rows reads nothing. The grouped form reads expert e's rows from offsets
on the device, and may gather its activation rows through a row index (the routed tokens' codes
quantized once per token, not once per routed copy): no host sync, so a CUDA graph captures it.

Numerics: y = sum over K blocks b of (sum_k q[n, k] * xq[m, k]) * s[n // 128, b] * xs[m, b], each
product of e4m3 codes exact, each block's sum in the tensor core's accumulator (Hopper's adder keeps
fewer bits than fp32 within an MMA; promoted to fp32 every block), rounded once to bf16. The weight-
only kernel and the trainer multiply bf16(q * s) by bf16(xq * xs) instead: the same values when the
scales are powers of two (ue8m0), within a bf16 rounding of each operand otherwise. Only decode steps
use it: their outputs feed sampling, while the engine's scoring and prefill keep the trainer's bits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from skyq.quant.kernels._common import cdiv

BLOCK = 128
"""The K step: one weight scale block and one activation scale tile (both 128 columns)."""


@triton.jit
def _w8a8_kernel(
    xq_ptr, xs_ptr, q_ptr, s_ptr, y_ptr, off_ptr, idx_ptr,
    M, N, K, MT,
    sxm, sxsm, sxsk, sqe, sqn, sse, ssn, ssk, sym,
    BLK_N: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    GROUPED: tl.constexpr, GATHER: tl.constexpr,
):  # fmt: skip
    """y[m, n] for N tile `program_id(0)` of weight `program_id(1)` and its row tiles j, j + MT, ...
    (j = `program_id(2)`): acc[n, m] = sum over K blocks of dot(q[n, blk], xq[row(m), blk]) * s[n //
    BLK_N, blk] * xs[row(m), blk]. GROUPED: the weight's rows are off[e]:off[e + 1] (else 0:M);
    GATHER: activation row idx[m] for output row m (else m). BN divides BLK_N (one weight scale a
    program and block); BK == 128, the scale blocks' width; K rows of unit stride."""
    pid_n = tl.program_id(0)
    e = tl.program_id(1)
    pid_m = tl.program_id(2)
    if GROUPED:
        lo = tl.load(off_ptr + e)
        hi = tl.load(off_ptr + e + 1)
    else:
        lo = 0
        hi = M
    rn = pid_n * BN + tl.arange(0, BN)
    n_ok = rn < N
    q_rows = q_ptr + e.to(tl.int64) * sqe + rn[:, None].to(tl.int64) * sqn
    # the program's one scale row, as a [BM] tensor of one address (a broadcast load in the loop)
    s_row = (
        s_ptr + e.to(tl.int64) * sse + ((pid_n * BN) // BLK_N).to(tl.int64) * ssn + tl.zeros([BM], tl.int64)
    )
    for m0 in range(lo + pid_m * BM, hi, MT * BM):
        rm = m0 + tl.arange(0, BM)
        m_ok = rm < hi
        if GATHER:
            src = tl.load(idx_ptr + rm, mask=m_ok, other=0).to(tl.int64)
        else:
            src = rm.to(tl.int64)
        x_cols = xq_ptr + src[None, :] * sxm
        xs_rows = xs_ptr + src * sxsm
        acc = tl.zeros([BN, BM], dtype=tl.float32)
        for k0 in range(0, K, BK):
            rk = k0 + tl.arange(0, BK)
            k_ok = rk < K
            w = tl.load(q_rows + rk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            xt = tl.load(x_cols + rk[:, None], mask=k_ok[:, None] & m_ok[None, :], other=0.0)
            b = k0 // BK
            ws = tl.load(s_row + b * ssk)
            xsc = tl.load(xs_rows + b * sxsk, mask=m_ok, other=0.0)
            acc += tl.dot(w, xt) * (ws * xsc)[None, :]
        out = y_ptr + rm[None, :].to(tl.int64) * sym + rn[:, None]
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=n_ok[:, None] & m_ok[None, :])


def grouped_tiling(mean_rows: float) -> tuple[int, int, int, int, int]:
    """(BM, BN, MT, warps, stages) for experts of `mean_rows` routed rows each on average: 128 weight
    rows a program at 4 warps, the rows in tiles of 32 up to a mean of 16, else 64, one program an
    expert's row tiles. From the H200 sweep of Qwen3-30B-A3B's experts
    (`benchmarks/moe_decode.py --large --w8a8-configs`; docs/benchmarks.md): BM 64 best or within 3%
    from 32 rows an expert up, BM 32 at 8-16 rows; 128-row tiles at 8 warps and 64-row weight tiles
    lost at every mean."""
    if mean_rows <= 16:
        return 32, 128, 1, 4, 3
    return 64, 128, 1, 4, 4


def dense_tiling(rows: int) -> tuple[int, int, int, int, int]:
    """(BM, BN, MT, warps, stages) for a dense weight and `rows` rows: 64 weight rows a program (a
    dense weight has no experts to spread over the GPU), rows in tiles of 32 up to 128 rows, else 64,
    one program a row tile. On the H200 (`benchmarks/decode.py --only large --w8a8-configs`, session
    19): best or within 15% of each cell's best at 128-512 rows of 1024-5120 x 1024-4096 weights;
    128-row weight tiles at 8 warps took 2-4x longer."""
    bm = 32 if rows <= 128 else 64
    return bm, 64, cdiv(rows, bm), 4, 3


def _launch(
    xq: Tensor, xs: Tensor, q: Tensor, s: Tensor, y: Tensor, offsets: Tensor | None, index: Tensor | None,
    rows: int, mean_rows: float, config: tuple[int, int, int, int, int] | None,
) -> Tensor:  # fmt: skip
    """One launch over q [E, N, K] / s [E, ceil(N/128), ceil(K/128)]; config (BM, BN, MT, warps, stages)."""
    experts, n, k = q.shape
    if config is None:
        config = grouped_tiling(mean_rows) if offsets is not None else dense_tiling(rows)
    bm, bn, mt, warps, stages = config
    mt = mt or cdiv(rows, bm)  # 0: one program a row tile
    if BLOCK % bn:
        raise ValueError(f"fp8 w8a8: a {bn}-row weight tile does not divide the {BLOCK}-row scale block")
    if rows == 0 or n == 0:
        return y
    dummy = y  # an unused pointer argument (GROUPED / GATHER off)
    _w8a8_kernel[(cdiv(n, bn), experts, mt)](
        xq, xs, q, s, y, offsets if offsets is not None else dummy, index if index is not None else dummy,
        rows, n, k, mt,
        xq.stride(0), *xs.stride(), *q.stride()[:2], *s.stride(), y.stride(0),
        BLK_N=BLOCK, BM=bm, BN=bn, BK=BLOCK, GROUPED=offsets is not None, GATHER=index is not None,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return y


def linear(
    xq: Tensor,
    xs: Tensor,
    q: Tensor,
    s: Tensor,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    config: tuple[int, int, int, int, int] | None = None,
) -> Tensor:
    """y [M, N] (out_dtype) from activation codes xq e4m3 [M, K] (unit stride along K) with scales
    xs fp32 [M, ceil(K/128)] and weight codes q e4m3 [N, K] (unit stride along K) with 128 x 128 block
    scales s fp32 [ceil(N/128), ceil(K/128)]; shapes checked by the caller, no host sync. `config`
    (BM, BN, MT, warps, stages) for sweeps (MT 0: one program a row tile); by default `dense_tiling`."""
    m = xq.shape[0]
    y = torch.empty((m, q.shape[0]), dtype=out_dtype, device=xq.device)
    return _launch(xq, xs, q.unsqueeze(0), s.unsqueeze(0), y, None, None, m, m, config)


def linear_grouped(
    xq: Tensor,
    xs: Tensor,
    q: Tensor,
    s: Tensor,
    offsets: Tensor,
    *,
    index: Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    config: tuple[int, int, int, int, int] | None = None,
) -> Tensor:
    """y [T, N] (out_dtype) for T routed rows sorted by expert (expert e's rows offsets[e]:offsets[e +
    1], offsets int32 [E + 1] on the device, offsets[E] == T): row m multiplies activation codes
    xq[index[m]] (xq[m] without `index`, int32/int64 [T]) e4m3 [*, K] with scales xs fp32 [*,
    ceil(K/128)] by expert e's weight codes q e4m3 [E, N, K] with block scales s fp32 [E, ceil(N/128),
    ceil(K/128)]. Trusts the offsets' and index's values (built on the device from the routing); no
    host sync. `config` as `linear`'s (MT: programs an expert's row tiles are spread over); by default
    `grouped_tiling` of the mean rows an expert."""
    t = xq.shape[0] if index is None else index.shape[0]
    y = torch.empty((t, q.shape[1]), dtype=out_dtype, device=xq.device)
    return _launch(xq, xs, q, s, y, offsets, index, t, t / max(q.shape[0], 1), config)
