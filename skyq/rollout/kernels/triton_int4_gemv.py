"""Triton weight-only INT4 linear for decode: y = x @ dequant(W)^T from compressed-tensors'
`pack-quantized` symmetric INT4 (eight 4-bit codes an int32 word, one bf16 scale a group of G
columns), dense or grouped over MoE experts.

Decode multiplies a few rows by the whole weight, so it is bound by the weight bytes: an INT4 weight
is 0.5 B an element plus its scales (1/16 B at G = 32), against bf16's 2 B. Without this kernel the
engine dequantized every INT4 weight to bf16 on each call (reading 0.5 B, writing and re-reading 2 B
an element) and ran the per-expert loop over MoE experts, whose host sync kept INT4 decode steps out
of CUDA graphs.

Swap-AB, as `triton_fp8_gemv`: a [BN, TK] tile of weights is the MMA's first operand and the few
activation rows (16 to 64 a tile) its second, y^T = W x^T. Each program loads its tile's words,
shifts out the eight nibbles of each (code = nibble - 8), multiplies each code by its group's scale
and rounds to bf16, which is `int4.dequantize_packed`'s weight bit for bit (`q.to(bf16) * s` is
torch's fp32 product rounded once to bf16), so the products are exact in fp32 and accumulate in fp32:
the result is `x.float() @ dequantize_packed(...).float().T` up to fp32 summation order, rounded once
to x's dtype, the value the engine's prefill and the trainer compute from that weight.

Dense: K may be split over programs (`_write_out`'s deterministic in-kernel reduction, as the FP8
kernel's). Grouped: program (n, e, j) takes N tile n of expert e's weight and that expert's row tiles
j, j + MT, ... from the routing's offsets on the device (no host sync; an expert without rows reads
nothing).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from skyq.quant.kernels import triton_int4_dequant
from skyq.quant.kernels._common import cdiv, sm_count
from skyq.quant.kernels.triton_int4_dequant import dequantized_words
from skyq.rollout.kernels._gemv import gemv_outputs
from skyq.rollout.kernels.triton_fp8_gemv import _arrival_counters, _capability, _write_out

WORD = 8
"""Codes an int32 word."""


@triton.jit
def _w4_kernel(
    x_ptr, p_ptr, s_ptr, y_ptr, part_ptr, cnt_ptr, off_ptr,
    M, N, K, k_per_split, MT,
    sxm, spe, spn, sse, ssn, sym,
    G: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, TK: tl.constexpr, SPLIT: tl.constexpr,
    GROUPED: tl.constexpr, ASM: tl.constexpr,
):  # fmt: skip
    """y[m, n] = sum_k x[m, k] * bf16(q[n, k] * s[n, k // G]) for N tile `program_id(0)`:
    GROUPED: of expert e = `program_id(1)`, rows off[e]:off[e + 1] in tiles j, j + MT, ... (j =
    `program_id(2)`); else row tile `program_id(1)` of M rows and K split `program_id(2)` (k_per_split
    columns each, a multiple of TK; SPLIT > 1 reduces the partials in split order). Words and scales
    of unit stride along K; G a multiple of 8 (a word's codes share a scale)."""
    pid_n = tl.program_id(0)
    if GROUPED:
        e = tl.program_id(1).to(tl.int64)
        lo = tl.load(off_ptr + e)
        hi = tl.load(off_ptr + e + 1)
        first = lo + tl.program_id(2) * BM
        k_lo = 0
        pid_s = 0
    else:
        e = 0
        hi = M
        first = tl.program_id(1) * BM
        pid_s = tl.program_id(2)
        k_lo = pid_s * k_per_split
    rn = pid_n * BN + tl.arange(0, BN)
    n_ok = rn < N
    words_per_row = K // 8
    p_rows = p_ptr + e * spe + rn[:, None].to(tl.int64) * spn
    s_rows = s_ptr + e * sse + rn[:, None].to(tl.int64) * ssn
    for m0 in range(first, hi, MT * BM):
        rm = m0 + tl.arange(0, BM)
        m_ok = rm < hi
        x_cols = x_ptr + rm[None, :].to(tl.int64) * sxm
        acc = tl.zeros([BN, BM], dtype=tl.float32)
        for t in range(0, k_per_split, TK):
            k0 = k_lo + t
            rw = k0 // 8 + tl.arange(0, TK // 8)
            w_ok = n_ok[:, None] & (rw < words_per_row)[None, :]
            words = tl.load(p_rows + rw[None, :], mask=w_ok, other=0)
            # one scale a word (G % 8 == 0); masked words get scale 0, so their weights are 0
            s = tl.load(s_rows + ((rw * 8) // G)[None, :], mask=w_ok, other=0.0).to(tl.float32)
            w = dequantized_words(words, s, BN, TK, ASM)
            rk = k0 + tl.arange(0, TK)
            xt = tl.load(x_cols + rk[:, None], mask=(rk[:, None] < K) & m_ok[None, :], other=0.0)
            acc = tl.dot(w, xt.to(tl.bfloat16), acc)
        if GROUPED:
            out = y_ptr + rm[None, :].to(tl.int64) * sym + rn[:, None]
            tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=n_ok[:, None] & m_ok[None, :])
        else:
            _write_out(acc, rn, rm, n_ok, m_ok, y_ptr, part_ptr, cnt_ptr, M, N, sym, 1, pid_s, SPLIT, BN, BM)


gluon_wo = None
"""`gluon_wo_gemv` where this Triton has the Gluon API it is written against (3.6), else None: then
INT4 takes `_w4_kernel` everywhere and MXFP8 decodes from dequantized weights."""
if tuple(int(p) for p in triton.__version__.split(".")[:2]) >= (3, 6):
    try:
        from skyq.rollout.kernels import gluon_wo_gemv as gluon_wo
    except (ImportError, AttributeError):  # pragma: no cover - a Gluon API change
        gluon_wo = None

GLUON = True
"""Launches without an explicit `config` on a CUDA device of compute capability >= 9 go to
`gluon_wo_gemv` (each thread dequantizes the words of its own MMA operand fragments in registers;
no shared memory in the K loop): on the H200 (`benchmarks/decode.py --only int4`; docs/benchmarks.md, M4, "The decode kernels' tuning rules") it
beat this kernel, and bf16, on every fused dense shape at 1 and 64 rows, and on the grouped experts.
False: `_w4_kernel` always (the A/B in the benchmarks and tests)."""


KERNEL_MAX_ROWS = 64
"""`int4_mxfp8_linear.int4_weight_only_linear` (and `mxfp8_weight_only_linear`, the same Gluon kernel body)
take the decode kernel up to this many rows; past it, only while rows x N x K is at most
`KERNEL_MAX_WORK`, else the weight is dequantized once for bf16's GEMM: each row tile of the decode
kernels dequantizes the whole weight again (on the H200 at 256 rows the fused q/k/v took several
times bf16's time on the Gluon INT4 kernel; docs/benchmarks.md, M4, "The decode kernels' tuning rules")."""

KERNEL_MAX_WORK = 300_000_000
"""rows x N x K up to which a decode linear past `KERNEL_MAX_ROWS` rows stays on the kernel: a small
weight's dequantize + GEMM is mostly two launches' fixed cost. Fitted on the H200 sweep of kernel
against dequantize + linear past 64 rows (`benchmarks/decode.py --only int4` / `--only mxfp8 --batches
64 65 128 256 --shapes ...`; docs/benchmarks.md, M4, "The decode kernels' tuning rules", with the one shape the rule misses): the kernel won up to about
this much work and lost beyond it."""


def dequantizes_first(rows: int, n: int, k: int) -> bool:
    """Whether a dense weight-only decode linear of `rows` rows by an N x K weight dequantizes the
    weight once for bf16's GEMM rather than run the decode kernel (`KERNEL_MAX_ROWS`,
    `KERNEL_MAX_WORK`)."""
    return rows > KERNEL_MAX_ROWS and rows * n * k > KERNEL_MAX_WORK


ASM_MAX_ROWS = 32
"""Row tiles above this dequantize in the Triton formulation (the same bits): on the H200
(`benchmarks/decode.py --only int4`; docs/benchmarks.md, M4, "The decode kernels' tuning rules") the PTX was faster at 1-32 rows and slower at 64."""


def gluon_applies(x: Tensor) -> bool:
    """`gluon_wo_gemv` takes launches on x's device (see `GLUON`): its PTX's bf16x2 arithmetic
    needs compute capability >= 9."""
    return GLUON and gluon_wo is not None and x.is_cuda and _capability(x.device.index or 0) >= 9


def supports(group_size: int, k: int) -> bool:
    """Scale groups the kernel reads: a multiple of 8 columns (a word's codes share a scale) that
    divides K, K a whole number of words."""
    return k % WORD == 0 and group_size > 0 and group_size % WORD == 0 and k % group_size == 0


def _row_tile(rows: int) -> int:
    return min(64, max(16, triton.next_power_of_2(max(rows, 1))))


def tiling(m: int, n: int, k: int, sms: int) -> tuple[int, int, int, int, int, int]:
    """(BM, BN, TK, split, warps, stages) of a dense launch: the rows in one tile of 16-64, 64 weight
    rows and 128 columns a step at 4 warps, K split in powers of two while twice the programs stay
    within 3 an SM and each split keeps >= 2 K steps. Tuned on the H200 sweep at 1-64 rows of
    2048-12288 x 2048-6144 weights (docs/benchmarks.md, M4, "The decode kernels' tuning rules"), where it is the best or close to it; TK 256 and 512 spilled
    or ran out of shared memory, 128-row tiles at 8 warps lost everywhere."""
    bm, bn, tk = _row_tile(m), 64, 128
    tiles = cdiv(n, bn) * cdiv(m, bm)
    steps = cdiv(k, tk)
    split = 1
    while split < 16 and 2 * tiles * split <= 3 * sms and steps >= 4 * split:
        split *= 2
    return bm, bn, tk, split, 4, 3


def grouped_tiling(mean_rows: float) -> tuple[int, int, int, int, int, int]:
    """(BM, BN, TK, MT, warps, stages) of a grouped launch: an expert's rows in tiles of 16 up to a
    mean of 16 rows an expert, else 32, one program per N tile of 64 rows, 128 columns a step. Tuned on
    the H200 sweep of Qwen3-30B-A3B's experts at 1-256 tokens, top-8 (docs/benchmarks.md, M4, "The decode kernels' tuning rules"): 16-row tiles best at 1-64
    tokens, 32 best for down at 256 tokens."""
    return (16 if mean_rows <= 16 else 32), 64, 128, 1, 4, 3


def linear(
    x: Tensor,
    packed: Tensor,
    scale: Tensor,
    *,
    group_size: int,
    config: tuple[int, int, int, int, int, int] | None = None,
) -> Tensor:
    """y [M, N] in x's dtype for bf16 x [M, K] (unit stride along K), packed int32 [N, K/8] and bf16
    scale [N, K/G] (both unit stride along K); shapes checked by the caller, no host sync. `config`
    (BM, BN, TK, split, warps, stages) for sweeps; by default `tiling`. Without `config`,
    `gluon_wo_gemv.linear` where `gluon_applies`."""
    m, k = x.shape
    n = packed.shape[0]
    if config is None and gluon_applies(x):
        return gluon_wo.linear(
            x, packed, scale, group_size=group_size, sms=sm_count(x.device), counters=_arrival_counters
        )
    bm, bn, tk, split, warps, stages = config or tiling(m, n, k, sm_count(x.device))
    k_per_split = cdiv(cdiv(k, tk), split) * tk
    split = cdiv(k, k_per_split)
    grid = (cdiv(n, bn), cdiv(m, bm), split)
    y, part, counters = gemv_outputs(x, m, n, grid, _arrival_counters)
    if m == 0 or n == 0:
        return y
    _w4_kernel[grid](
        x, packed, scale, y, part, counters, y,
        m, n, k, k_per_split, grid[1],
        x.stride(0), 0, packed.stride(0), 0, scale.stride(0), y.stride(0),
        G=group_size, BM=bm, BN=bn, TK=tk, SPLIT=split, GROUPED=False, ASM=triton_int4_dequant.asm(x) and bm <= ASM_MAX_ROWS,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return y


def linear_grouped(
    x: Tensor,
    packed: Tensor,
    scale: Tensor,
    offsets: Tensor,
    *,
    group_size: int,
    config: tuple[int, int, int, int, int, int] | None = None,
) -> Tensor:
    """y [T, N] in x's dtype for T rows of bf16 x [T, K] sorted by expert (expert e's rows
    offsets[e]:offsets[e + 1], offsets int32 [E + 1] on the device, offsets[E] == T), packed int32
    [E, N, K/8], bf16 scale [E, N, K/G]. Trusts the offsets' values; no host sync. `config` (BM, BN,
    TK, MT, warps, stages) for sweeps; by default `grouped_tiling` of the mean rows an expert.
    Without `config`, `gluon_wo_gemv.linear_grouped` where `gluon_applies`."""
    t, k = x.shape
    experts, n = packed.shape[:2]
    if config is None and gluon_applies(x):
        return gluon_wo.linear_grouped(
            x, packed, scale, offsets, group_size=group_size, sms=sm_count(x.device)
        )
    bm, bn, tk, mt, warps, stages = config or grouped_tiling(t / max(experts, 1))
    y = torch.empty((t, n), dtype=x.dtype, device=x.device)
    if t == 0 or n == 0 or experts == 0:
        return y
    _w4_kernel[(cdiv(n, bn), experts, mt)](
        x, packed, scale, y, y, y, offsets,
        t, n, k, cdiv(k, tk) * tk, mt,
        x.stride(0), packed.stride(0), packed.stride(1), scale.stride(0), scale.stride(1), y.stride(0),
        G=group_size, BM=bm, BN=bn, TK=tk, SPLIT=1, GROUPED=True, ASM=triton_int4_dequant.asm(x) and bm <= ASM_MAX_ROWS,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return y
