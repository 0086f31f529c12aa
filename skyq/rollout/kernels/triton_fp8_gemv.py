"""Triton weight-only FP8 linear for decode: y = x @ dequant(W)^T with W in e4m3 + blockwise scales.

Decode multiplies a few rows of activations (M <= 64) by the whole weight, so it is bound by the
weight bytes: reading 1 B per weight instead of bf16's 2 B is what makes it faster. The
weight is dequantized in registers, never written out. The product is computed as y^T = W x^T
("swap-AB"): a BN x TK tile of weights is the MMA's first operand straight from registers, and the
few activation rows are its second (N = 16..64), so a batch of one wastes no weight bytes and no
tile goes back through shared memory.

Numerics: each weight is dequantized exactly as `fp8_blockwise.dequantize(q, s, dtype=bfloat16)`
does, the weight the trainer and the engine's prefill path (`F.linear` on the dequantized bf16
weight) multiply by: the e4m3 code widened to fp32 (exact), times its block's fp32 scale_inv in
fp32, rounded to bf16 (round to nearest even). Products of bf16 weights and bf16 activations are
exact in fp32 and accumulate in fp32, so the result is `x.float() @ dequantize(q, s,
bfloat16).float().T` up to fp32 summation order (tiles, MMA, split-K), then one rounding to x's
dtype: the same value a bf16 GEMM with fp32 accumulation gives on that weight, not always the same
bits. The GPU tests bound the difference from both. (The kernel used to scale each tile's fp32
partial sum instead, `sum(x * q) * s`: one multiply per output rather than per weight, but without
the bf16 rounding of `q * s` that the trainer's weight has: on the H200 that alone put fp8's
train/rollout mismatch above bf16's, and at 0 with this rounding; docs/benchmarks.md, M5.)

When too few output tiles exist to fill the GPU, K is split across programs. Each writes an fp32
partial and bumps a per-tile arrival counter; the last program to arrive sums the partials in
split order (deterministic: the same bits whichever program is last), writes y and resets the
counter, so there is one launch per linear and no memset (see `_arrival_counters`).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

from skyq.quant.kernels._common import cdiv, sm_count
from skyq.rollout.kernels._gemv import gemv_outputs

try:  # programmatic dependent launch (Hopper+): Triton >= 3.3
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - older Triton: launched without PDL
    gdc_launch_dependents = gdc_wait = None

_gluon = None
if tuple(int(p) for p in triton.__version__.split(".")[:2]) >= (3, 6):
    # the explicit-layout kernel, written against Triton 3.6's (experimental) Gluon API; with an
    # older Triton, or one whose Gluon lacks what it uses, `_gemv_kernel` everywhere
    try:
        from skyq.rollout.kernels import gluon_fp8_gemv as _gluon
    except (ImportError, AttributeError):  # pragma: no cover - a Gluon API change
        _gluon = None

GLUON = True
"""Decode through `gluon_fp8_gemv` (16-byte code loads straight into the MMA operand registers, no
shared memory) where it applies: at most `GLUON_MAX_M` rows, a CUDA device of compute capability
>= 8.9 (its PTX converts e4m3 in hardware), weight blocks of >= 64 power-of-two columns, K a multiple of 4 with unit stride. Else, and
under the interpreter, or with an explicit `config`, `_gemv_kernel`. False: `_gemv_kernel` always
(the A/B in benchmarks/decode.py)."""

GLUON_MAX_M = 16
"""Batches of more rows go to `_gemv_kernel` (but see `GLUON_SMALL_WEIGHT`): the Gluon kernel holds
each warp's activation tile in registers (they grow with the rows), and on the H200 (benchmarks/decode.py
--gluon; docs/benchmarks.md, M4, "The decode kernels' tuning rules") its best variant lost to `_gemv_kernel` at 32 and 64 rows in every fused shape while winning
at 1-16; rechecked with its codes loaded evict-first, it tied or lost at 64 rows and at 32 rows the model
with each cell's best variant was no faster."""

GLUON_SMALL_WEIGHT = 1 << 22
"""Weights of at most this many elements take the Gluon kernel at up to `DECODE_ROWS` rows too, the
rows in tiles of 8 or 16 that re-read the weight tile from L2 (`gluon_fp8_gemv.tiling`). Such a
weight gives `_gemv_kernel`'s 64 x 64 tiles too few programs to fill the GPU (24 for small_moe's fused
q/k/v, 1536 x 1024). On the H200 (`benchmarks/decode.py --only gluon-sweep --shapes ... --batches 24 32
48 64`; docs/benchmarks.md, M4, "The decode kernels' tuning rules") the Gluon kernel beat it clearly at 32 and 64 rows on such weights (1536 x 1024, 1024 x 1024,
2048 x 2048); from 5120 x 2048 (10.5M elements) up Triton won, or the best Gluon variant (a tiling per
cell) won by little."""

DECODE_ROWS = 64
"""The most rows `GLUON_SMALL_WEIGHT` weights send to the Gluon kernel: the engine's decode batches
(`skyq.rollout.quantized_linear.DECODE_MAX_ROWS`, which this kernel layer does not import)."""

PDL = False
"""Opt-in programmatic dependent launch (CUDA devices of compute capability >= 9, Triton >= 3.3):
each program prefetches its weight and scale lines into L2, waits for the previous kernel, then
lets the next one launch. Off by default: on the H200 (benchmarks/decode.py --tuned) it made the
graphed decode step slower at batch 1 and 64 (docs/benchmarks.md, M4, "The decode kernels' tuning rules")."""


@triton.jit
def _prefetch_l2(ptrs):
    tl.inline_asm_elementwise(
        "prefetch.global.L2 [$1]; // $0", "=r,l", [ptrs], dtype=tl.int32, is_pure=False, pack=1
    )


@triton.jit
def _gemv_kernel(
    x_ptr, q_ptr, s_ptr, y_ptr, p_ptr, cnt_ptr,
    M, N, K, k_per_split,
    sxm, sxk, sqn, sqk, ssn, ssk, sym, syn,
    BLK_N: tl.constexpr, BLK_K: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, TK: tl.constexpr, SPLIT: tl.constexpr, TILES: tl.constexpr,
    PDL: tl.constexpr, UNIFORM: tl.constexpr, SCALES_IN_LOOP: tl.constexpr, SUB: tl.constexpr,
):  # fmt: skip
    """acc[n, m] = sum over this split's K range, in TK-column tiles, of bf16(q[n, k] *
    s[n // BLK_N, k // BLK_K]) * x[m, k] (TK divides BLK_K, one scale per row per tile, or with
    SCALES_IN_LOOP is SUB whole blocks, each its own sub-tile and scale). SPLIT == 1 writes
    y[m, n]; else partial p[split, m, n] and the last program of the tile reduces. TILES: a power of
    two >= the split's K tiles (k_per_split / TK), the width of the PDL prefetch.
    PDL: launched as a programmatic dependent launch: the weight and scale lines are prefetched into
    L2 while the previous kernel finishes, and nothing is read or written before `gdc_wait`.
    UNIFORM: BN divides BLK_N, so all rows of a program's tile share one scale row and each K tile
    has one scale: a scalar, whose multiply leaves the codes' conversion to the MMA operand layout
    in registers (a per-row scale vector of another layout made Triton route every weight tile
    through shared memory, which made the decode slower than bf16's on the H200; docs/benchmarks.md,
    M4, "The decode kernels' tuning rules")."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_s = tl.program_id(2)
    rn = pid_n * BN + tl.arange(0, BN)
    rm = pid_m * BM + tl.arange(0, BM)
    n_ok = rn < N
    m_ok = rm < M
    q_rows = q_ptr + rn[:, None].to(tl.int64) * sqn
    x_cols = x_ptr + rm[None, :].to(tl.int64) * sxm
    k_lo = pid_s * k_per_split
    ti = tl.arange(0, TILES)
    tk0 = k_lo + ti * TK
    if PDL:
        # L2 prefetches (hints: no data is read) of this program's code lines and scales, issued
        # before waiting for the previous kernel, whose output x is; addresses clamped in bounds.
        # (The same prefetches without PDL, before the first load, made the graphed decode step
        # slower on the H200; docs/benchmarks.md, M4, "The decode kernels' tuning rules".)
        kc = tl.minimum(tk0, K - 1)[None, :]
        nc = tl.minimum(rn, N - 1)[:, None].to(tl.int64)
        _prefetch_l2(q_ptr + nc * sqn + kc * sqk)
        _prefetch_l2(s_ptr + (nc // BLK_N) * ssn + (kc // BLK_K) * ssk)
        gdc_wait()  # the previous kernel is complete and its writes are visible
        gdc_launch_dependents()  # the next kernel may start its prefetches
    if not SCALES_IN_LOOP:
        # Every scale the split needs, loaded before the K loop (a scalar load inside it is not
        # pipelined: each tile would wait one DRAM round trip for its scale).
        t_ok = (tk0 < K) & (ti * TK < k_per_split)
        if UNIFORM:
            s_row = tl.load(
                s_ptr + ((pid_n * BN) // BLK_N).to(tl.int64) * ssn + (tk0 // BLK_K) * ssk,
                mask=t_ok,
                other=0.0,
            )
        else:
            s_all = tl.load(
                s_ptr + (rn // BLK_N).to(tl.int64)[:, None] * ssn + (tk0 // BLK_K)[None, :] * ssk,
                mask=n_ok[:, None] & t_ok[None, :],
                other=0.0,
            )
    acc = tl.zeros([BN, BM], dtype=tl.float32)
    # TK columns per loop step, in SUB sub-tiles of TK // SUB (<= BLK_K) columns, each with its own
    # scale: SUB > 1 (in-loop scales only) puts SUB times the weight bytes in flight per stage.
    SUB_K: tl.constexpr = TK // SUB
    for t in range(0, k_per_split, TK):  # k_per_split % TK == 0; the last split's tail is masked
        for j in tl.static_range(SUB):
            k0 = k_lo + t + j * SUB_K
            rk = k0 + tl.arange(0, SUB_K)
            k_ok = rk < K
            codes = tl.load(q_rows + rk[None, :] * sqk, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            xt = tl.load(x_cols + rk[:, None] * sxk, mask=k_ok[:, None] & m_ok[None, :], other=0.0)
            # bf16(fp32(q) * s), `fp8_blockwise.dequantize`'s rounding, so the MMA multiplies the very
            # bf16 weight the trainer does. e4m3 -> fp32 is exact (through fp16: full-rate
            # instructions, where Triton's direct e4m3 -> bf16 was slower in the H200 sweep).
            if SCALES_IN_LOOP:
                # A [BN, 1] tensor loaded in the loop (pipelined like the codes; one address for all
                # rows when UNIFORM): Triton then converts the codes straight from shared memory in
                # the MMA operand layout. A scale computed in registers (below) makes it convert the
                # whole bf16 tile through shared memory instead (st.shared + ldmatrix per tile in the
                # sm_90 PTX).
                if UNIFORM:
                    s_rows = (
                        s_ptr + (pid_n * BN // BLK_N).to(tl.int64) * ssn + tl.zeros([BN, 1], dtype=tl.int64)
                    )
                else:
                    s_rows = s_ptr + (rn // BLK_N).to(tl.int64)[:, None] * ssn
                s = tl.load(s_rows + (k0 // BLK_K) * ssk, mask=n_ok[:, None] & (k0 < K), other=0.0)
                w = (codes.to(tl.float32) * s).to(tl.bfloat16)
            elif UNIFORM:  # picked from the preloaded ones by a masked sum: exact, one nonzero term
                s = tl.sum(tl.where(ti == t // TK, s_row, 0.0), axis=0)
                w = (codes.to(tl.float32) * s).to(tl.bfloat16)
            else:
                s = tl.sum(tl.where(ti[None, :] == t // TK, s_all, 0.0), axis=1)
                w = (codes.to(tl.float32) * s[:, None]).to(tl.bfloat16)
            acc = tl.dot(w, xt.to(tl.bfloat16), acc)
    _write_out(acc, rn, rm, n_ok, m_ok, y_ptr, p_ptr, cnt_ptr, M, N, sym, syn, pid_s, SPLIT, BN, BM)


@triton.jit
def _write_out(acc, rn, rm, n_ok, m_ok, y_ptr, p_ptr, cnt_ptr, M, N, sym, syn, pid_s,
               SPLIT: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr):  # fmt: skip
    """acc [BN, BM] (y^T of this tile) -> y; with SPLIT > 1 an fp32 partial, and the last program
    of the tile to arrive sums the partials in split order, writes y and resets its counter."""
    out_mask = n_ok[:, None] & m_ok[None, :]
    out_off = rm[None, :].to(tl.int64) * sym + rn[:, None] * syn
    if SPLIT == 1:
        tl.store(y_ptr + out_off, acc.to(y_ptr.dtype.element_ty), mask=out_mask)
    else:
        mn = M * N
        tl.store(p_ptr + pid_s.to(tl.int64) * mn + out_off, acc, mask=out_mask)
        tl.debug_barrier()  # every thread's partial is stored before the release below
        tile = tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
        if tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel") == SPLIT - 1:
            # unrolled, so all SPLIT partial loads are in flight at once; summed in split order
            total = tl.zeros([BN, BM], dtype=tl.float32)
            for i in tl.static_range(SPLIT):
                total += tl.load(p_ptr + i * mn + out_off, mask=out_mask, other=0.0, cache_modifier=".cg")
            tl.store(y_ptr + out_off, total.to(y_ptr.dtype.element_ty), mask=out_mask)
            tl.atomic_xchg(cnt_ptr + tile, 0)


@triton.jit
def _gemv_cc_kernel(
    x_ptr, q_ptr, s_ptr, y_ptr, p_ptr, cnt_ptr,
    M, N, K, k_per_split,
    sxm, sxk, sqn, sqk, ssn, ssk, sym, syn,
    BLK_N: tl.constexpr, BLK_K: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, TK: tl.constexpr, SPLIT: tl.constexpr, SUB: tl.constexpr,
    UNIFORM: tl.constexpr,
):  # fmt: skip
    """`_gemv_kernel`'s product on the CUDA cores, for a batch of a few rows (BM <= 4): no MMA, so
    no operand layout to reach and nothing staged in shared memory; each weight tile is loaded
    straight into registers (8-byte vectors along K), dequantized as bf16(fp32(q) * s), widened
    (exact) and multiplied by the rows of x (rounded to bf16 as the MMA path rounds them), the
    products summed elementwise in fp32 [BN, BM, TK / SUB] across the K loop and reduced over K at
    the end. The same weight and products as `_gemv_kernel`; fp32 sums in another order. A sweep
    variant (`linear(config=(BM < 16, ...))`), not in the default tiling: on the H200 it matched the
    MMA kernel at one row, beat it at two on three of four shapes and lost at four (docs/benchmarks.md,
    M4)."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_s = tl.program_id(2)
    SUB_K: tl.constexpr = TK // SUB
    rn = pid_n * BN + tl.arange(0, BN)
    rm = pid_m * BM + tl.arange(0, BM)
    n_ok = rn < N
    m_ok = rm < M
    # Everything in [BN, BM, SUB_K] index space, the weights [BN, 1, SUB_K] and the rows of x
    # [1, BM, SUB_K] loaded as such, so the products need no layout conversion (shared memory).
    n3 = rn[:, None, None]
    q_rows = q_ptr + n3.to(tl.int64) * sqn
    x_rows = x_ptr + rm[None, :, None].to(tl.int64) * sxm
    m3_ok = m_ok[None, :, None]
    n3_ok = n_ok[:, None, None]
    s_row = s_ptr + (pid_n * BN // BLK_N).to(tl.int64) * ssn
    k_lo = pid_s * k_per_split
    acc = tl.zeros([BN, BM, SUB_K], dtype=tl.float32)
    for t in range(0, k_per_split, TK):  # k_per_split % TK == 0; the last split's tail is masked
        for j in tl.static_range(SUB):
            k0 = k_lo + t + j * SUB_K
            rk = (k0 + tl.arange(0, SUB_K))[None, None, :]
            k_ok = rk < K
            # 8 codes per thread (8-byte vectors), as many as one 16-byte vector of bf16 x holds:
            # the weight tile and x then share one register layout (else Triton converts the tile)
            codes = tl.load(q_rows + tl.max_contiguous(rk, [1, 1, 8]) * sqk, mask=n3_ok & k_ok, other=0.0)
            if UNIFORM:  # one scale for the whole sub-tile
                s = tl.load(s_row + (k0 // BLK_K) * ssk, mask=k0 < K, other=0.0)
            else:
                s = tl.load(
                    s_ptr + (n3 // BLK_N).to(tl.int64) * ssn + (k0 // BLK_K) * ssk, mask=n3_ok & (k0 < K)
                )
            w = (codes.to(tl.float32) * s).to(tl.bfloat16).to(tl.float32)
            # x loaded at the product's full shape (the same row for every weight row, from L1):
            # a [1, BM, SUB_K] load gets a layout of its own, and the tile was converted to it
            xs = tl.load(x_rows + rk * sxk + n3 * 0, mask=m3_ok & k_ok & n3_ok, other=0.0)
            acc += w * xs.to(tl.bfloat16).to(tl.float32)
    _write_out(
        tl.sum(acc, axis=2), rn, rm, n_ok, m_ok, y_ptr, p_ptr, cnt_ptr, M, N, sym, syn, pid_s, SPLIT, BN, BM
    )


SCALES_IN_LOOP_MAX_M = 8
"""Batches of at most this many rows load the scales in the K loop (`SCALES_IN_LOOP`), larger ones
before it. On the H200 (benchmarks/decode.py; docs/benchmarks.md, M4, "The decode kernels' tuning rules") the in-loop load made the graphed decode
step faster at batch 1 and slower at 16 and 32."""


@functools.cache
def _capability(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


@functools.cache
def _has_e4m3_cvt(index: int) -> bool:
    """`cvt.rn.f16x2.e4m3x2`, which the Gluon kernel's dequantization is written in: sm_89+."""
    return torch.cuda.get_device_capability(index) >= (8, 9)


_counters: dict[torch.device, Tensor] = {}


def _arrival_counters(device: torch.device, tiles: int) -> Tensor:
    """A zeroed int32 buffer of >= `tiles` counters, which every split launch leaves zeroed, one per
    device: launches in stream order share it (decode runs on one stream; two split launches that
    overlap on two streams would not). A CUDA-graph capture before any eager launch on the device
    records its own zeroed buffer (a memset node), as the shared one is not yet initialised."""
    buf = _counters.get(device)
    if buf is not None and buf.numel() >= tiles:
        return buf
    if device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return torch.zeros(tiles, dtype=torch.int32, device=device)
    buf = _counters[device] = torch.zeros(max(tiles, 4096), dtype=torch.int32, device=device)
    return buf


def supports(block_size: tuple[int, int]) -> bool:
    """Weight blocks the kernel tiles: any row count, a power-of-two column count >= 16."""
    bn, bk = block_size
    return bn > 0 and bk >= 16 and bk & (bk - 1) == 0


def tiling(m: int, n: int, k: int, block_k: int, sms: int) -> tuple[int, int, int, int]:
    """(BM, BN, TK, split): the batch padded to the dot's minimum of 16 (at most 64 per tile), 64
    weight rows per program, K split in powers of two up to 8 while there are fewer than ~2
    programs per SM and each split keeps >= 4 K tiles (>= 8 at 64 batch rows, whose split-K
    partials are 4x larger). Tuned on the H200 sweeps of benchmarks/decode.py
    (docs/benchmarks.md, M4, "The decode kernels' tuning rules"): 128-row tiles at 64 rows and one program per SM lost to this."""
    bm = min(64, max(16, triton.next_power_of_2(m)))
    bn = 64
    tk = min(128, block_k)
    tiles = cdiv(n, bn) * cdiv(m, bm)
    k_tiles = cdiv(k, tk)
    min_tiles = 8 if bm >= 64 else 4
    split = 1
    while split < 8 and tiles * split < 1.8 * sms and k_tiles >= min_tiles * 2 * split:
        split *= 2
    return bm, bn, tk, split


def launch_options(bm: int, bn: int, split_tiles: int) -> tuple[int, int]:
    """(num_warps, num_stages): 8 warps for 128-row weight tiles (4 spill registers there), and a
    3-stage pipeline (2 for a split of one K tile): 4 stages were slower or equal in every cell of
    the H200 sweep (docs/benchmarks.md, M4, "The decode kernels' tuning rules")."""
    return (8 if bn >= 128 else 4), max(2, min(3, split_tiles + 1))


def _gluon_applies(x: Tensor, q: Tensor, block_size: tuple[int, int]) -> bool:
    """The Gluon kernel takes this launch (see `GLUON`, `GLUON_SMALL_WEIGHT`): it reads q as int32
    words of four codes."""
    return (
        GLUON and _gluon is not None and x.device.type == "cuda"
        and (x.numel() <= GLUON_MAX_M * x.shape[-1]
             or (x.numel() <= DECODE_ROWS * x.shape[-1] and q.numel() <= GLUON_SMALL_WEIGHT))
        and _has_e4m3_cvt(x.device.index or 0)
        and _gluon.supports(block_size) and q.stride(1) == 1 and q.shape[1] % 4 == 0
        and q.stride(0) % 4 == 0 and q.storage_offset() % 4 == 0
    )  # fmt: skip


def grouped_applies(x: Tensor, q: Tensor, block_size: tuple[int, int]) -> bool:
    """The grouped Gluon kernel takes this launch: x on a CUDA device with the e4m3 conversion
    (compute capability >= 8.9), q [E, N, K] read as int32 words (unit stride along K, rows and
    experts 4-byte aligned)."""
    return (
        _gluon is not None and x.device.type == "cuda" and _has_e4m3_cvt(x.device.index or 0)
        and _gluon.supports(block_size) and q.stride(2) == 1 and q.shape[2] % 4 == 0
        and q.stride(1) % 4 == 0 and q.stride(0) % 4 == 0 and q.storage_offset() % 4 == 0
    )  # fmt: skip


def linear_grouped(
    x: Tensor, q: Tensor, scale_inv: Tensor, offsets: Tensor, *, block_size: tuple[int, int]
) -> Tensor:
    """`gluon_fp8_gemv.linear_grouped` on x's device (see `grouped_applies`)."""
    return _gluon.linear_grouped(x, q, scale_inv, offsets, block_size=block_size, sms=sm_count(x.device))


def linear(
    x: Tensor,
    q: Tensor,
    scale_inv: Tensor,
    *,
    block_size: tuple[int, int],
    config: tuple[int, int, int, int] | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> Tensor:
    """y [..., N] in x's dtype for x [..., K], q e4m3 [N, K], scale_inv fp32 [ceil(N/bn), ceil(K/bk)]
    (shapes checked by the caller). No host sync. `config` (BM, BN, TK, split), `num_warps`,
    `num_stages`: for sweeps; by default `tiling` and `launch_options`. BM < 16 (a power of two
    <= 4) runs the CUDA-core kernel (`_gemv_cc_kernel`), else the MMA one. Without `config`, on a
    GPU, `gluon_fp8_gemv.linear` where `GLUON` says it applies."""
    if config is None and _gluon_applies(x, q, block_size):
        return _gluon.linear(
            x, q, scale_inv, block_size=block_size, sms=sm_count(x.device), counters=_arrival_counters
        )
    x2 = x.reshape(-1, x.shape[-1])
    m, k = x2.shape
    n = q.shape[0]
    blk_n, blk_k = block_size
    bm, bn, tk, split = config or tiling(m, n, k, blk_k, sm_count(x.device))
    k_per_split = cdiv(cdiv(k, tk), split) * tk
    split = cdiv(k, k_per_split)
    warps, stages = launch_options(bm, bn, k_per_split // tk)
    # TK wider than a scale block: SUB sub-tiles of one block each, their scales loaded in the loop
    sub = max(1, tk // blk_k)
    in_loop = m <= SCALES_IN_LOOP_MAX_M or sub > 1
    if sub > 1 and tk % blk_k:
        raise ValueError(f"fp8 gemv: a K tile of {tk} columns is not a whole number of {blk_k}-column blocks")
    pdl = (
        PDL and sub == 1 and gdc_wait is not None and x.device.type == "cuda"
        and _capability(x.device.index or 0) >= 9
    )  # fmt: skip
    grid = (cdiv(n, bn), cdiv(m, bm), split)
    y, part, counters = gemv_outputs(x, m, n, grid, _arrival_counters)
    args = (x2, q, scale_inv, y, part, counters, m, n, k, k_per_split,
            *x2.stride(), *q.stride(), *scale_inv.stride(), *y.stride())  # fmt: skip
    shape = dict(BLK_N=blk_n, BLK_K=blk_k, BM=bm, BN=bn, TK=tk, SPLIT=split, SUB=sub, UNIFORM=blk_n % bn == 0)
    if bm < 16:  # a few rows on the CUDA cores
        _gemv_cc_kernel[grid](*args, **shape, num_warps=num_warps or warps, num_stages=num_stages or 1)
    else:
        _gemv_kernel[grid](
            *args, **shape,
            TILES=triton.next_power_of_2(k_per_split // tk), PDL=pdl, SCALES_IN_LOOP=in_loop, launch_pdl=pdl,
            num_warps=num_warps or warps, num_stages=num_stages or stages,
        )  # fmt: skip
    return y.reshape(*x.shape[:-1], n)
