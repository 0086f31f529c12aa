"""Triton weight-only FP8 linear for decode: y = x @ dequant(W)^T with W in e4m3 + blockwise scales.

Decode multiplies a few rows of activations (M <= 64) by the whole weight, so it is bound by the
weight bytes: reading 1 B per weight instead of bf16's 2 B is what makes it up to 2x faster. The
weight is dequantized in registers, never written out: each program loads a BN x TK tile of e4m3
codes, widens it to bf16 (exact: every e4m3 value is a bf16 value), multiplies it with the bf16
activations on the tensor cores with fp32 accumulation (bf16 x bf16 products are exact in fp32),
and applies the fp32 block scale to that partial sum before adding it to the accumulator.

That is the reference `x.float() @ dequantize(q, s, float32).T` reassociated: per block,
`sum(x * q) * s` instead of `sum(x * (q * s))`, an fp32 rounding difference (~1e-7 relative per
block), far below the final rounding to x's dtype. The GPU test bounds it.

When too few output tiles exist to fill the GPU (N / BN below ~2 programs per SM), K is split
across programs; each writes an fp32 partial and a second kernel sums them in a fixed order, so
results are deterministic (no atomics).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

from skyq.quant.kernels._common import cdiv


@triton.jit
def _gemv_kernel(
    x_ptr, q_ptr, s_ptr, y_ptr,
    M, N, K,
    sxm, sxk, sqn, sqk, ssn, ssk, sys, sym, syn,
    BLK_N: tl.constexpr, BLK_K: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, TK: tl.constexpr, KT: tl.constexpr,
):  # fmt: skip
    """y[split, m, n] = sum over this split's KT tiles of TK columns of x[m, k] * q[n, k] *
    s[n // BLK_N, k // BLK_K]. TK divides BLK_K, so each K tile has one scale per row. KT is a
    constexpr (a runtime trip count trips the Triton 3.6 interpreter); decode shapes give a few."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_s = tl.program_id(2)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    m_ok = rm < M
    n_ok = rn < N
    k_lo = pid_s * (KT * TK)
    x_rows = x_ptr + rm[:, None].to(tl.int64) * sxm
    q_rows = q_ptr + rn[:, None].to(tl.int64) * sqn
    s_rows = s_ptr + (rn // BLK_N).to(tl.int64) * ssn
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for t in range(KT):  # the last split's tiles past K are fully masked
        k0 = k_lo + t * TK
        rk = k0 + tl.arange(0, TK)
        k_ok = rk[None, :] < K
        x = tl.load(x_rows + rk[None, :] * sxk, mask=m_ok[:, None] & k_ok, other=0.0)
        codes = tl.load(q_rows + rk[None, :] * sqk, mask=n_ok[:, None] & k_ok, other=0.0)
        w = codes.to(tl.bfloat16)
        s = tl.load(s_rows + (k0 // BLK_K) * ssk, mask=n_ok & (k0 < K), other=0.0)
        part = tl.dot(x.to(tl.bfloat16), tl.trans(w), out_dtype=tl.float32)
        acc += part * s[None, :]
    out = y_ptr + pid_s.to(tl.int64) * sys + rm[:, None].to(tl.int64) * sym + rn[None, :] * syn
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _sum_splits_kernel(p_ptr, y_ptr, MN, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    """y[i] = sum_s p[s, i] in split order (deterministic), cast to y's dtype."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < MN
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(SPLIT):
        acc += tl.load(p_ptr + s * MN + offs, mask=ok, other=0.0)
    tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=ok)


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Multiprocessors of `device`; an H200's 132 for CPU tensors (the Triton interpreter)."""
    return _sm_count(device.index or 0) if device.type == "cuda" else 132


def supports(block_size: tuple[int, int]) -> bool:
    """Weight blocks the kernel tiles: any row count, a power-of-two column count >= 16."""
    bn, bk = block_size
    return bn > 0 and bk >= 16 and bk & (bk - 1) == 0


def tiling(m: int, n: int, k: int, block_k: int, sms: int) -> tuple[int, int, int, int]:
    """(BM, BN, TK, split): M padded to the dot's minimum of 16 (at most 64 per tile), 64-wide N
    tiles, K split (up to 4 ways) until there are about two programs per SM."""
    bm = min(64, max(16, triton.next_power_of_2(m)))
    bn = 64  # H200 sweep (benchmarks/decode.py): 64-wide tiles split 4 ways won at M = 16 and 64
    tk = min(128, block_k)
    tiles = cdiv(n, bn) * cdiv(m, bm)
    k_tiles = cdiv(k, tk)
    split = 1
    while split < 4 and tiles * split < 2 * sms and split * 2 * 2 <= k_tiles:
        split *= 2
    return bm, bn, tk, split


def linear(
    x: Tensor,
    q: Tensor,
    scale_inv: Tensor,
    *,
    block_size: tuple[int, int],
    config: tuple[int, int, int, int] | None = None,
    num_warps: int = 4,
    num_stages: int = 3,
) -> Tensor:
    """y [..., N] in x's dtype for x [..., K], q e4m3 [N, K], scale_inv fp32 [ceil(N/bn), ceil(K/bk)]
    (shapes checked by the caller). No host sync. `config`, `num_warps`, `num_stages`: sweeps."""
    x2 = x.reshape(-1, x.shape[-1])
    m, k = x2.shape
    n = q.shape[0]
    blk_n, blk_k = block_size
    bm, bn, tk, split = config or tiling(m, n, k, blk_k, sm_count(x.device))
    k_per_split = cdiv(cdiv(k, tk), split) * tk
    split = cdiv(k, k_per_split)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    part = y.unsqueeze(0) if split == 1 else torch.empty((split, m, n), dtype=torch.float32, device=x.device)
    grid = (cdiv(n, bn), cdiv(m, bm), split)
    _gemv_kernel[grid](
        x2, q, scale_inv, part,
        m, n, k,
        *x2.stride(), *q.stride(), *scale_inv.stride(), *part.stride(),
        BLK_N=blk_n, BLK_K=blk_k, BM=bm, BN=bn, TK=tk, KT=k_per_split // tk,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    if split > 1:
        block = 1024
        _sum_splits_kernel[(cdiv(m * n, block),)](part, y, m * n, SPLIT=split, BLOCK=block, num_warps=4)
    return y.reshape(*x.shape[:-1], n)
