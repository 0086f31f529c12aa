"""Weight-only FP8 decode linear in Gluon (Triton's explicit-layout dialect): no shared memory in the K loop.

`triton_fp8_gemv._gemv_kernel` lets Triton lay the weight tile out: the codes go through shared
memory (cp.async in, then one 2-byte `ld.shared` per two codes into the MMA operand layout), and
on the H200 its K loop issued ~7.3 instructions per weight element, which made it issue-bound well
below DRAM bandwidth (docs/benchmarks.md, M4). Here the layouts are written out so
that every thread loads its weight codes with 16-byte global loads straight into the registers the
tensor-core operand needs, and converts them there: ~3.4 instructions per element, all of them
the conversion and the MMA (verified in the sm_90 PTX by tests/quant/test_gluon_gemv.py).

The trick is a permutation of K inside each 64-column chunk, applied to both operands (a dot
product does not care in which order its terms are summed, only that both factors agree). The
`mma.sync.m16n8k16` A fragment gives lane (g, t) = (lane // 4, lane % 4) the columns {2t, 2t+1,
2t+8, 2t+9} of rows g and g+8 in each 16-column step. Over four steps (64 columns) the thread
takes the 16 *contiguous* memory columns 16t .. 16t+15: step j's slot 2t+i holds memory column
16t+4j+i and slot 2t+8+i holds 16t+4j+2+i. In layout terms: the load layout of the [BN, KC] code
tile puts (i, h, j) = the low four bits of k in registers, t in lane bits 0-1, g in lane bits 2-4,
row+8 in a register bit and 16-row groups in warps; `reshape`/`permute` rename memory column
16t+4j+2h+i to MMA column 16j+8h+2t+i, and the result *is* the A operand layout
(`convert_layout(..., assert_trivial=True)`: the compiler proves no data moves). The activations
get the same permutation as the B operand (n8 per MMA; every warp reads its K group's whole x
tile, which stays in L1).

The codes are loaded with the L1 and L2 evict-first policy: each is read once, and without the
hint the weight stream pushed the small tensors everything else re-reads out of L2 (the activation
tiles of every program, and the inputs of the norm and add kernels between the GEMVs). On the H200
that alone raised the decode model's tokens/s at batch 1-16, about half of the gain in the GEMVs; an
L1-only bypass (`.cg`, no L2 policy) instead, an evict-last hint on the activations, or a
programmatic dependent launch (waiting for the previous kernel after loading or L2-prefetching the
first codes) did not help (docs/benchmarks.md, M4, "the codes loaded evict-first").

The K range is spread over warps of one program rather than over programs: the MMA layout is
3-D ([K groups, rows, batch], the batch dimension of a batched mma.sync on the high warp bits), each
group of warps sums its own part of K, and the groups' sums are added in the program through shared
memory once at the end. Splitting K across programs instead (kept for tiles too few to fill the SMs)
needs a fix-up through memory: fp32 partials, an acq_rel atomic, and the last program to arrive
reloading and summing them, a chain of dependent memory round trips that was about a quarter of a
call on the H200 at 1-8 rows (docs/benchmarks.md, M4, "the K range on warps of one program").

Numerics are `triton_fp8_gemv`'s: each weight is bf16(fp32(code) * scale) (`fp8_blockwise.dequantize`
to bf16, the trainer's weight), products exact in fp32, fp32 sums (here in mma.sync order, then the
K groups' sums in a fixed order), one rounding to x's dtype. Split-K writes fp32 partials reduced in
split order by the last program to arrive (deterministic), as the Triton kernel does.

Gluon kernels compile for the GPU only (no interpreter): on CPU the tests compile this kernel to
sm_90 PTX and check its instructions; tests/gpu check its numbers on the H200.
"""

from __future__ import annotations

import functools

import torch
import triton
from torch import Tensor
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from skyq.quant.kernels._common import cdiv
from skyq.rollout.kernels._gemv import gemv_outputs

CHUNK = 64
"""K columns over which each thread's 16 contiguous codes are spread (four 16-column MMA steps)."""


def _bits(n: int) -> int:
    return n.bit_length() - 1


def _tile_layout(
    rows: int, kc: int, warps: int, cols: int, weights: bool, kw: int
) -> gl.DistributedLinearLayout:
    """A [kw, rows, kc // cols] tile (kw K groups, one per K warp) of elements holding `cols` K
    columns each (int32 words of four codes or two bf16, or single values): per thread 16 contiguous
    columns (one 16-byte load of codes, two of bf16) in registers, then further 64-column chunks;
    lanes take (t, g) = (lane % 4, lane // 4), t the column group, g the row. Weights: rows g and g
    + 8 in registers, the N warps 16-row groups, then further 16*warps-row groups in registers: after
    the K permutation, the mma.sync A operand layout. Activations: rows g, g + 8, ... in registers,
    every N warp a copy (the B operand of each warp's MMAs is its group's whole tile). The K warps
    (the high warp bits, as in the MMA layout) take the groups."""
    reg = [[0, 0, 1 << i] for i in range(_bits(16 // cols))]
    reg += [[0, 8, 0]] if weights else []
    reg += [[0, 0, CHUNK // cols << i] for i in range(_bits(kc // CHUNK))]
    if weights:
        reg += [[0, 16 * warps << i, 0] for i in range(_bits(rows // (16 * warps)))]
        warp = [[0, 16 << i, 0] for i in range(_bits(warps))]
    else:
        reg += [[0, 8 << i, 0] for i in range(_bits(rows // 8))]
        warp = [[0, 0, 0]] * _bits(warps)
    warp += [[1 << i, 0, 0] for i in range(_bits(kw))]
    lane = [[0, 0, 16 // cols], [0, 0, 32 // cols], [0, 1, 0], [0, 2, 0], [0, 4, 0]]
    return gl.DistributedLinearLayout(reg, lane, warp, [], [kw, rows, kc // cols])


@functools.cache
def word_layout(bn: int, kc: int, warps: int, kw: int = 1) -> gl.DistributedLinearLayout:
    """The weight tile read as int32 words of four codes: [kw, bn, kc // 4], 4 words a thread."""
    return _tile_layout(bn, kc, warps, 4, weights=True, kw=kw)


@functools.cache
def act_layout(bm: int, kc: int, warps: int, kw: int = 1) -> gl.DistributedLinearLayout:
    """The activation tile (fp32, or bf16 in odd strides) element by element: [kw, bm, kc]."""
    return _tile_layout(bm, kc, warps, 1, weights=False, kw=kw)


@functools.cache
def act_word_layout(bm: int, kc: int, warps: int, kw: int = 1) -> gl.DistributedLinearLayout:
    """The bf16 activation tile read as int32 words of two columns: [kw, bm, kc // 2]."""
    return _tile_layout(bm, kc, warps, 2, weights=False, kw=kw)


_SPLIT2 = gl.constexpr("mov.b32 {$0, $1}, $2;")
"""One int32 word -> its two bf16 halves (low half first): no arithmetic, only register naming."""


@gluon.jit
def _mma_order(t, KW: gl.constexpr, ROWS: gl.constexpr, KC: gl.constexpr):
    """[KW, ROWS, KC] with memory column c*64 + 16t + 4j + 2h + i renamed MMA column c*64 + 16j +
    8h + 2t + i."""
    return t.reshape([KW, ROWS, KC // 64, 4, 4, 2, 2]).permute(0, 1, 2, 4, 5, 3, 6).reshape([KW, ROWS, KC])


_DEQUANT4 = gl.constexpr("""{
.reg .b16 c01, c23, f0, f1, f2, f3;
.reg .b32 h01, h23, p01, p23;
.reg .f32 g0, g1, g2, g3;
mov.b32 {c01, c23}, $4;
cvt.rn.f16x2.e4m3x2 h01, c01;
cvt.rn.f16x2.e4m3x2 h23, c23;
mov.b32 {f0, f1}, h01;
mov.b32 {f2, f3}, h23;
cvt.f32.f16 g0, f0;
cvt.f32.f16 g1, f1;
cvt.f32.f16 g2, f2;
cvt.f32.f16 g3, f3;
mul.rn.f32 g0, g0, $5;
mul.rn.f32 g1, g1, $5;
mul.rn.f32 g2, g2, $5;
mul.rn.f32 g3, g3, $5;
cvt.rn.bf16x2.f32 p01, g1, g0;
cvt.rn.bf16x2.f32 p23, g3, g2;
mov.b32 {$0, $1}, p01;
mov.b32 {$2, $3}, p23;
}""")
"""Four e4m3 codes (one int32 word, byte i = column 4w + i) -> bf16(fp32(code) * scale) each: two
`cvt.rn.f16x2.e4m3x2` (exact), four widenings to fp32 (exact), four fp32 multiplies (round to
nearest), two `cvt.rn.bf16x2.f32` (round to nearest even): `fp8_blockwise.dequantize` to bf16."""


@gluon.jit
def _load_codes(q_rows, s_ptrs, s_cols, k0, K, ssk, rw, kcw, BLK_K: gl.constexpr, EVEN_K: gl.constexpr):
    """The code words [KW, BN, KC // 4] of each K group's KC columns from its base + k0 (q_rows and
    s_cols hold the groups' bases), evict-first (read once), and their scales; columns past K are
    masked to zero (rows past N were clamped to the last row: read, never stored)."""
    if EVEN_K:
        words = gl.load(q_rows + (k0 // 4 + rw), eviction_policy="evict_first")
        s = gl.load(s_ptrs + ((s_cols + k0) // BLK_K) * ssk)
    else:
        words = gl.load(q_rows + (k0 // 4 + rw), mask=(kcw + k0) < K, other=0, eviction_policy="evict_first")
        s = gl.load(s_ptrs + ((s_cols + k0) // BLK_K) * ssk, mask=(s_cols + k0) < K, other=0.0)
    return words, s


@gluon.jit
def _load_x(x_rows, k0, K, rkx, kcx, EVEN_K: gl.constexpr, XW: gl.constexpr):
    """The activations [KW, BM, KC] (with XW, bf16 pairs as int32 words) of each group's KC columns
    from k0; rows past M clamped, columns past K masked to zero."""
    XPW: gl.constexpr = 2 if XW else 1  # activation columns per loaded element
    if EVEN_K:
        return gl.load(x_rows + (k0 // XPW + rkx))
    return gl.load(x_rows + (k0 // XPW + rkx), mask=(kcx + k0) < K, other=0)


@gluon.jit
def _load_step(ptrs, k0, K, ssk, BLK_K: gl.constexpr, EVEN_K: gl.constexpr, XW: gl.constexpr):
    """`_load_codes` and `_load_x` of the step at k0; `ptrs` as `_tile_pointers` returns them."""
    q_rows, x_rows, s_ptrs, s_cols, rw, kcw, rkx, kcx = ptrs
    words, s = _load_codes(q_rows, s_ptrs, s_cols, k0, K, ssk, rw, kcw, BLK_K, EVEN_K)
    return words, _load_x(x_rows, k0, K, rkx, kcx, EVEN_K, XW), s


@gluon.jit
def _load_step_or_zero(ptrs, k0, k_end, K, ssk, BLK_K: gl.constexpr, EVEN_K: gl.constexpr, XW: gl.constexpr):
    """`_load_step` at k0 if k0 < k_end (the groups' length), else step 0 with a zero scale."""
    valid = k0 < k_end
    words, xt, s = _load_step(ptrs, gl.where(valid, k0, 0), K, ssk, BLK_K, EVEN_K, XW)
    return words, xt, gl.where(valid, s, 0.0)


@gluon.jit
def _weight_operand(words, s, DA: gl.constexpr, KW: gl.constexpr, BN: gl.constexpr, KC: gl.constexpr,
                    UNIFORM: gl.constexpr):  # fmt: skip
    """The [KW, BN, KC] bf16 A operand in MMA column order from the step's code words: bf16(fp32(code)
    * s) (e4m3 -> fp32 through fp16: exact, full-rate `cvt.rn.f16x2.e4m3x2`), in the registers the
    words were loaded into. s: a scale per group ([KW], UNIFORM) or per group and row ([KW, BN])."""
    if UNIFORM:
        sc = gl.broadcast(s[:, None, None], words)[0]
    else:
        sc = gl.broadcast(s[:, :, None], words)[0]
    e0, e1, e2, e3 = gl.inline_asm_elementwise(
        _DEQUANT4, "=h,=h,=h,=h,r,r", [words, sc],
        dtype=(gl.bfloat16, gl.bfloat16, gl.bfloat16, gl.bfloat16), is_pure=True, pack=1,
    )  # fmt: skip
    w = gl.join(gl.join(e0, e1), gl.join(e2, e3)).permute(0, 1, 2, 4, 3).reshape([KW, BN, KC])
    return gl.convert_layout(_mma_order(w, KW, BN, KC), DA, assert_trivial=True)


@gluon.jit
def _bf16_pairs(xw, KW: gl.constexpr, BM: gl.constexpr, KC: gl.constexpr):
    """[KW, BM, KC // 2] int32 words -> the [KW, BM, KC] bf16 columns they hold (no data movement)."""
    lo, hi = gl.inline_asm_elementwise(
        _SPLIT2, "=h,=h,r", [xw], dtype=(gl.bfloat16, gl.bfloat16), is_pure=True, pack=1
    )
    return gl.join(lo, hi).reshape([KW, BM, KC])


@gluon.jit
def _mma_step(words, xt, s, acc, DA: gl.constexpr, DB: gl.constexpr, KW: gl.constexpr, BN: gl.constexpr,
              BM: gl.constexpr, KC: gl.constexpr, UNIFORM: gl.constexpr, XW: gl.constexpr):  # fmt: skip
    """acc[g] += bf16(fp32(codes[g]) * s[g]) @ bf16(x[g])^T over each group g's KC columns."""
    a = _weight_operand(words, s, DA, KW, BN, KC, UNIFORM)
    if XW:
        xb = _bf16_pairs(xt, KW, BM, KC)
    else:
        xb = xt.to(gl.bfloat16)
    b = gl.convert_layout(_mma_order(xb, KW, BM, KC).permute(0, 2, 1), DB, assert_trivial=True)
    return mma_v2(a, b, acc)


@gluon.jit
def _store_out(acc, MMA: gl.constexpr, y_ptr, p_ptr, cnt_ptr, M, N, sym, pid_n, pid_m, pid_s,
               BN: gl.constexpr, BM: gl.constexpr, SPLIT: gl.constexpr):  # fmt: skip
    """acc [KW, BN, BM] (the K groups' sums of y^T of this tile) -> their sum (across the K warps,
    through shared memory, in a fixed order) -> y; with SPLIT > 1 an fp32 partial, and the last
    program of the tile to arrive sums the partials in split order, writes y and resets its
    counter."""
    OUT: gl.constexpr = gl.SliceLayout(0, MMA)
    tile_sum = gl.sum(acc, axis=0)
    on = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, OUT))
    om = pid_m * BM + gl.arange(0, BM, layout=gl.SliceLayout(0, OUT))
    out_mask = (on < N)[:, None] & (om < M)[None, :]
    out_off = om[None, :].to(gl.int64) * sym + on[:, None]
    if SPLIT == 1:
        gl.store(y_ptr + out_off, tile_sum.to(y_ptr.dtype.element_ty), mask=out_mask)
    else:
        mn = M * N
        gl.store(p_ptr + pid_s.to(gl.int64) * mn + out_off, tile_sum, mask=out_mask)
        gl.thread_barrier()  # every thread's partial is stored before the release below
        tile = pid_m * gl.num_programs(0) + pid_n
        if gl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel") == SPLIT - 1:
            total = gl.zeros([BN, BM], gl.float32, layout=OUT)
            for i in gl.static_range(SPLIT):  # unrolled: all partial loads in flight; summed in split order
                total += gl.load(p_ptr + i * mn + out_off, mask=out_mask, other=0.0, cache_modifier=".cg")
            gl.store(y_ptr + out_off, total.to(y_ptr.dtype.element_ty), mask=out_mask)
            gl.atomic_xchg(cnt_ptr + tile, 0)


@gluon.jit
def _tile_pointers(x_ptr, q_ptr, s_ptr, M, N, k_per_group, sxm, sqn, ssn, pid_n, pid_m, pid_s,
                   BLK_N: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, XCOLS: gl.constexpr,
                   KC: gl.constexpr, KW: gl.constexpr, LW: gl.constexpr, LX: gl.constexpr,
                   UNIFORM: gl.constexpr):  # fmt: skip
    """A program's code-row and activation-row pointers at each K group's first column (group g of
    split s starts at column (s * KW + g) * k_per_group), its scale pointers and the groups' first
    columns (s_cols), the word and activation column offsets (XCOLS loaded elements a step) and the
    column of every loaded element at step 0 (kcw, kcx: for the masks past K). Rows past N or M
    read the last row (in bounds, no mask in the K loop); their sums are not stored."""
    XPW: gl.constexpr = KC // XCOLS
    LW2: gl.constexpr = gl.SliceLayout(2, LW)
    LX2: gl.constexpr = gl.SliceLayout(2, LX)
    rn = gl.minimum(pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, LW2)), N - 1)
    kbw = (pid_s * KW + gl.arange(0, KW, layout=gl.SliceLayout(1, LW2))) * k_per_group
    rw = gl.arange(0, KC // 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, LW)))[None, None, :]
    rm = gl.minimum(pid_m * BM + gl.arange(0, BM, layout=gl.SliceLayout(0, LX2)), M - 1)
    kbx = (pid_s * KW + gl.arange(0, KW, layout=gl.SliceLayout(1, LX2))) * k_per_group
    rkx = gl.arange(0, XCOLS, layout=gl.SliceLayout(0, gl.SliceLayout(1, LX)))[None, None, :]
    q_rows = q_ptr + rn[None, :, None].to(gl.int64) * sqn + (kbw // 4)[:, None, None]
    x_rows = x_ptr + rm[None, :, None].to(gl.int64) * sxm + (kbx // XPW)[:, None, None]
    if UNIFORM:  # BN divides BLK_N: one scale row for the tile, a scale per group and step
        s_ptrs = s_ptr + ((pid_n * BN) // BLK_N).to(gl.int64) * ssn
        s_cols = kbw
    else:  # each row its block's scale
        s_ptrs = s_ptr + (rn // BLK_N).to(gl.int64)[None, :] * ssn
        s_cols = kbw[:, None]
    return (
        q_rows,
        x_rows,
        s_ptrs,
        s_cols,
        rw,
        kbw[:, None, None] + 4 * rw,
        rkx,
        kbx[:, None, None] + XPW * rkx,
    )


@gluon.jit
def _gemv_kernel(
    x_ptr, q_ptr, s_ptr, y_ptr, p_ptr, cnt_ptr,
    M, N, K, k_per_group,
    sxm, sqn, ssn, ssk, sym,
    BLK_N: gl.constexpr, BLK_K: gl.constexpr,
    BM: gl.constexpr, BN: gl.constexpr, KC: gl.constexpr, SPLIT: gl.constexpr, W: gl.constexpr, KW: gl.constexpr,
    LW: gl.constexpr, LX: gl.constexpr, UNIFORM: gl.constexpr, EVEN_K: gl.constexpr, PREFETCH: gl.constexpr,
    XW: gl.constexpr,
):  # fmt: skip
    """y[m, n] (or split partials) = sum over this split's K range of bf16(q * s)[n, k] * x[m, k]
    with mma.sync; q (int32 words of four codes) and x (int32 pairs with XW) have unit stride along
    K. W warps take the tile's rows, KW warps (KW groups of W) the split's K range: group g the
    k_per_group columns from (split * KW + g) * k_per_group; the groups' sums are added through
    shared memory at the end. PREFETCH: how many steps' codes, activations and scales are loaded
    before a step's are converted and multiplied (0, 1, or 2 in ping-pong buffers; 3: one step's
    codes and scales, the activations loaded at their own step, which holds fewer registers at many
    batch rows)."""
    MMA: gl.constexpr = gl.NVMMADistributedLayout(
        version=[2, 0], warps_per_cta=[KW, W, 1], instr_shape=[1, 16, 8]
    )
    DA: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    DB: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
    pid_n = gl.program_id(0)
    pid_m = gl.program_id(1)
    pid_s = gl.program_id(2)
    ptrs = _tile_pointers(
        x_ptr, q_ptr, s_ptr, M, N, k_per_group, sxm, sqn, ssn, pid_n, pid_m, pid_s,
        BLK_N, BM, BN, KC // 2 if XW else KC, KC, KW, LW, LX, UNIFORM,
    )  # fmt: skip
    q_rows, x_rows, s_ptrs, s_cols, rw, kcw, rkx, kcx = ptrs
    acc = gl.zeros([KW, BN, BM], gl.float32, layout=MMA)
    if PREFETCH == 2:
        # Two steps in flight, ping-pong: each buffer is reloaded right after its MMA consumed it, so
        # no register moves. A step past the groups' end loads step 0 again (in bounds) with scale 0:
        # it adds exact zeros (finite x).
        a_w, a_x, a_s = _load_step(ptrs, 0, K, ssk, BLK_K, EVEN_K, XW)
        b_w, b_x, b_s = _load_step_or_zero(ptrs, KC, k_per_group, K, ssk, BLK_K, EVEN_K, XW)
        for k0 in range(0, k_per_group, 2 * KC):
            acc = _mma_step(a_w, a_x, a_s, acc, DA, DB, KW, BN, BM, KC, UNIFORM, XW)
            a_w, a_x, a_s = _load_step_or_zero(ptrs, k0 + 2 * KC, k_per_group, K, ssk, BLK_K, EVEN_K, XW)
            acc = _mma_step(b_w, b_x, b_s, acc, DA, DB, KW, BN, BM, KC, UNIFORM, XW)
            b_w, b_x, b_s = _load_step_or_zero(ptrs, k0 + 3 * KC, k_per_group, K, ssk, BLK_K, EVEN_K, XW)
    elif PREFETCH == 1:
        acc = _k_loop_next_ahead(
            ptrs, acc, K, ssk, k_per_group, BLK_K, EVEN_K, XW, DA, DB, KW, BN, BM, KC, UNIFORM
        )
    elif PREFETCH == 3:  # the next step's codes and scales ahead, the activations at their step
        words, s = _load_codes(q_rows, s_ptrs, s_cols, 0, K, ssk, rw, kcw, BLK_K, EVEN_K)
        for k0 in range(KC, k_per_group, KC):
            nxt_words, nxt_s = _load_codes(q_rows, s_ptrs, s_cols, k0, K, ssk, rw, kcw, BLK_K, EVEN_K)
            xt = _load_x(x_rows, k0 - KC, K, rkx, kcx, EVEN_K, XW)
            acc = _mma_step(words, xt, s, acc, DA, DB, KW, BN, BM, KC, UNIFORM, XW)
            words = nxt_words
            s = nxt_s
        xt = _load_x(x_rows, k_per_group - KC, K, rkx, kcx, EVEN_K, XW)
        acc = _mma_step(words, xt, s, acc, DA, DB, KW, BN, BM, KC, UNIFORM, XW)
    else:  # latency hidden by the other warps on the SM only
        for k0 in range(0, k_per_group, KC):
            words, xt, s = _load_step(ptrs, k0, K, ssk, BLK_K, EVEN_K, XW)
            acc = _mma_step(words, xt, s, acc, DA, DB, KW, BN, BM, KC, UNIFORM, XW)
    _store_out(acc, MMA, y_ptr, p_ptr, cnt_ptr, M, N, sym, pid_n, pid_m, pid_s, BN, BM, SPLIT)


@gluon.jit
def _k_loop_next_ahead(ptrs, acc, K, ssk, k_per_group, BLK_K: gl.constexpr, EVEN_K: gl.constexpr,
                       XW: gl.constexpr, DA: gl.constexpr, DB: gl.constexpr, KW: gl.constexpr, BN: gl.constexpr,
                       BM: gl.constexpr, KC: gl.constexpr, UNIFORM: gl.constexpr):  # fmt: skip
    """The K loop of PREFETCH 1: the next step's loads issued before this step's math (values moved
    along)."""
    words, xt, s = _load_step(ptrs, 0, K, ssk, BLK_K, EVEN_K, XW)
    for k0 in range(KC, k_per_group, KC):
        nxt_words, nxt_xt, nxt_s = _load_step(ptrs, k0, K, ssk, BLK_K, EVEN_K, XW)
        acc = _mma_step(words, xt, s, acc, DA, DB, KW, BN, BM, KC, UNIFORM, XW)
        words = nxt_words
        xt = nxt_xt
        s = nxt_s
    return _mma_step(words, xt, s, acc, DA, DB, KW, BN, BM, KC, UNIFORM, XW)


@gluon.jit
def _gemv_grouped_kernel(
    x_ptr, q_ptr, s_ptr, y_ptr, off_ptr,
    N, K, k_per_group,
    sxm, sqe, sqn, sse, ssn, ssk, sym,
    BLK_N: gl.constexpr, BLK_K: gl.constexpr,
    BM: gl.constexpr, BN: gl.constexpr, KC: gl.constexpr, W: gl.constexpr, KW: gl.constexpr,
    LW: gl.constexpr, LX: gl.constexpr, UNIFORM: gl.constexpr, EVEN_K: gl.constexpr, XW: gl.constexpr,
):  # fmt: skip
    """Grouped (MoE experts) form of `_gemv_kernel`: x's rows are sorted by expert, expert e's rows
    being off[e]:off[e + 1]; program (n, e) multiplies them by N tile n of expert e's weight (q[e],
    its scales s[e]), BM rows at a time (the weight tile re-read from L2 past the first), the K
    loop of PREFETCH 1, no split. An expert without rows reads nothing."""
    MMA: gl.constexpr = gl.NVMMADistributedLayout(
        version=[2, 0], warps_per_cta=[KW, W, 1], instr_shape=[1, 16, 8]
    )
    DA: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    DB: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
    pid_n = gl.program_id(0)
    e = gl.program_id(1)
    start = gl.load(off_ptr + e)
    rows = gl.load(off_ptr + e + 1) - start
    x_e = x_ptr + start.to(gl.int64) * sxm
    y_e = y_ptr + start.to(gl.int64) * sym
    q_e = q_ptr + e.to(gl.int64) * sqe
    s_e = s_ptr + e.to(gl.int64) * sse
    for mt in range(0, gl.cdiv(rows, BM)):
        ptrs = _tile_pointers(
            x_e, q_e, s_e, rows, N, k_per_group, sxm, sqn, ssn, pid_n, mt, 0,
            BLK_N, BM, BN, KC // 2 if XW else KC, KC, KW, LW, LX, UNIFORM,
        )  # fmt: skip
        acc = gl.zeros([KW, BN, BM], gl.float32, layout=MMA)
        acc = _k_loop_next_ahead(
            ptrs, acc, K, ssk, k_per_group, BLK_K, EVEN_K, XW, DA, DB, KW, BN, BM, KC, UNIFORM
        )
        _store_out(acc, MMA, y_e, y_e, off_ptr, rows, N, sym, pid_n, mt, 0, BN, BM, 1)


def supports(block_size: tuple[int, int]) -> bool:
    """Weight blocks this kernel tiles: any row count, a power-of-two column count >= 64 (a K step
    of KC <= BLK_K columns then has one scale per row)."""
    bn, bk = block_size
    return bn > 0 and bk >= CHUNK and bk & (bk - 1) == 0


def tiling(m: int, n: int, k: int, block_k: int, sms: int) -> tuple[int, int, int, int, int, int]:
    """(BM, BN, KC, split, warps, kwarps): the batch padded to the MMA's 8 columns (at most 64 per
    tile; 9-16 rows as two 8-row tiles where 16-row tiles would give fewer than ~1.5 programs per
    SM: each program re-reads its weights from L2, with half the activation registers), 16 weight
    rows a program on one warp, 128-column steps (<= the scale block), and the K range on kwarps
    warps (powers of two up to 16, >= 2 steps each) until the weight tiles have ~7.5 warps per SM;
    the K range is split across programs (a fix-up through memory) only where fewer than half the
    SMs would have a program. Tuned on the H200 sweep of the fused model's shapes
    (benchmarks/decode.py --gluon; docs/benchmarks.md, M4, "The decode kernels' tuning rules"), where the K warps beat an earlier version's 64-row tiles on
    4 warps split 4-16 ways (whose split fix-up, an atomic and a reload of the partials by the last
    program, was a large part of a call) in every fused linear, and two 8-row tiles beat one 16-row
    tile at 16 rows.
    More than 16 rows (small weights only, `triton_fp8_gemv.GLUON_SMALL_WEIGHT`): tiles of 8 rows (at
    most 32 rows) or 16, each program re-reading its weight tile from L2, and 4 K warps where K has
    >= 8 steps: the best or close to it in every cell of the H200 sweep of 1536 x 1024, 1024 x 1024
    and 2048 x 2048 at 24-64 rows (same section), where the batch in one 32- or 64-row tile was
    slower."""
    kc = min(128, block_k)
    if m > 16:
        steps = cdiv(k, kc)
        kwarps = 1
        while kwarps < 4 and steps >= 4 * kwarps:
            kwarps *= 2
        return (8 if m <= 32 else 16), 16, kc, 1, 1, kwarps
    bm = min(64, max(8, triton.next_power_of_2(m)))
    weight_tiles = cdiv(n, 16)
    if bm == 16 and weight_tiles < 1.5 * sms:
        bm = 8
    tiles = weight_tiles * cdiv(m, bm)
    steps = cdiv(k, kc)
    kwarps = 1
    while kwarps < 16 and weight_tiles * kwarps < 7.5 * sms and steps >= 4 * kwarps:
        kwarps *= 2
    split = 1
    while split < 16 and tiles * split < 0.5 * sms and steps >= 4 * kwarps * split:
        split *= 2
    return bm, 16, kc, split, 1, kwarps


def launch_shape(k: int, kc: int, split: int, kwarps: int) -> tuple[int, int, bool]:
    """(k_per_group, split, even): each of the split * kwarps K groups takes k_per_group columns (a
    whole number of KC steps), splits past K are dropped, and `even` says every group lies inside
    K (no column masks)."""
    k_per_group = cdiv(cdiv(k, kc), split * kwarps) * kc
    split = cdiv(cdiv(k, k_per_group), kwarps)
    return k_per_group, split, split * kwarps * k_per_group == k


def linear(
    x: Tensor,
    q: Tensor,
    scale_inv: Tensor,
    *,
    block_size: tuple[int, int],
    sms: int,
    counters,
    config: tuple[int, int, int, int, int, int] | None = None,
    prefetch: int = 1,
) -> Tensor:
    """y [..., N] in x's dtype for x [..., K] (bf16 or fp32 values), q e4m3 [N, K] with unit
    stride along K, scale_inv fp32 [ceil(N/bn), ceil(K/bk)]; `supports(block_size)` holds. No host
    sync. `counters(device, tiles)`: a zeroed int32 buffer the split launches leave zeroed.
    `config` (BM, BN, KC, split, warps, kwarps) for sweeps; by default `tiling`: warps * kwarps
    warps a program, `warps` on the tile's rows, `kwarps` groups of them on parts of the split's K
    range, summed in the program. `prefetch`: steps loaded ahead of the math: 0, 1 (the next,
    values moved along; the default: fastest or close to it in most cells of the H200 sweep), 2 (two,
    ping-pong buffers: no moves, more registers; it spills at 32+ batch rows of 128-column
    steps), 3 (the next step's codes and scales; the activations at their own step)."""
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m, k = x2.shape
    n = q.shape[0]
    blk_n, blk_k = block_size
    bm, bn, kc, split, warps, kwarps = config or tiling(m, n, k, blk_k, sms)
    if bn % (16 * warps) or kc % CHUNK or blk_k % kc or bm < 8 or kwarps & (kwarps - 1):
        raise ValueError(
            f"gluon fp8 gemv: config {(bm, bn, kc, split, warps, kwarps)} does not tile block {block_size}"
        )
    k_per_group, split, even = launch_shape(k, kc, split, kwarps)
    words = q.view(torch.int32)  # four codes per word (K % 4 == 0, rows 4-byte aligned)
    # bf16 activations as int32 pairs: carried across the prefetch as whole registers
    xw = x2.dtype == torch.bfloat16 and k % 2 == 0 and x2.stride(0) % 2 == 0 and x2.storage_offset() % 2 == 0
    xin = x2.view(torch.int32) if xw else x2
    grid = (cdiv(n, bn), cdiv(m, bm), split)
    y, part, cnt = gemv_outputs(x, m, n, grid, counters)
    _gemv_kernel[grid](
        xin, words, scale_inv, y, part, cnt, m, n, k, k_per_group,
        xin.stride(0), words.stride(0), *scale_inv.stride(), y.stride(0),
        BLK_N=blk_n, BLK_K=blk_k, BM=bm, BN=bn, KC=kc, SPLIT=split, W=warps, KW=kwarps,
        LW=word_layout(bn, kc, warps, kwarps), LX=(act_word_layout if xw else act_layout)(bm, kc, warps, kwarps),
        UNIFORM=blk_n % bn == 0, EVEN_K=even, PREFETCH=prefetch, XW=xw, num_warps=warps * kwarps,
    )  # fmt: skip
    return y.reshape(*x.shape[:-1], n)


def grouped_tiling(
    rows: int, experts: int, n: int, k: int, block_k: int, sms: int
) -> tuple[int, int, int, int, int, int]:
    """(BM, BN, KC, split, warps, kwarps) of `linear_grouped` for `rows` routed rows over `experts`:
    BM 8, 16 or 32 by the mean rows an expert (a tile loops past it; 16 above a mean of 6, 32 above a
    mean of 12, for the large decode steps: tuned on the H200 sweeps of `benchmarks/moe_decode.py
    --sweep` and `--large` in docs/benchmarks.md, M4, "The decode kernels' tuning rules"), 16 weight rows a warp, 128-column steps, the K
    range on up to 4 warps while the active experts' tiles give fewer than ~7.5 warps an SM (the
    experts with rows are taken to be min(experts, rows))."""
    bm = 8 if rows <= 6 * experts else 16 if rows <= 12 * experts else 32
    kc = min(128, block_k)
    tiles = cdiv(n, 16) * max(1, min(experts, rows))
    steps = cdiv(k, kc)
    kwarps = 1
    while kwarps < 4 and tiles * kwarps < 7.5 * sms and steps >= 4 * kwarps:
        kwarps *= 2
    return bm, 16, kc, 1, 1, kwarps


def linear_grouped(
    x: Tensor,
    q: Tensor,
    scale_inv: Tensor,
    offsets: Tensor,
    *,
    block_size: tuple[int, int],
    sms: int,
    config: tuple[int, int, int, int, int, int] | None = None,
) -> Tensor:
    """y [T, N] for x [T, K] (bf16 or fp32, rows sorted by expert), q e4m3 [E, N, K] (each expert's
    [N, K] with unit stride along K), scale_inv fp32 [E, ceil(N/bn), ceil(K/bk)] and offsets int32 [E +
    1] on the device (expert e's rows off[e]:off[e + 1], off[E] == T). No host sync."""
    x2 = x if x.stride(-1) == 1 else x.contiguous()
    t, k = x2.shape
    e, n, _ = q.shape
    blk_n, blk_k = block_size
    bm, bn, kc, _split, warps, kwarps = config or grouped_tiling(t, e, n, k, blk_k, sms)
    k_per_group, _, even = launch_shape(k, kc, 1, kwarps)
    words = q.view(torch.int32)  # [E, N, K / 4]
    xw = x2.dtype == torch.bfloat16 and k % 2 == 0 and x2.stride(0) % 2 == 0 and x2.storage_offset() % 2 == 0
    xin = x2.view(torch.int32) if xw else x2
    y = torch.empty((t, n), dtype=x.dtype, device=x.device)
    if t == 0:
        return y
    _gemv_grouped_kernel[(cdiv(n, bn), e)](
        xin, words, scale_inv, y, offsets, n, k, k_per_group,
        xin.stride(0), words.stride(0), words.stride(1), *scale_inv.stride(), y.stride(0),
        BLK_N=blk_n, BLK_K=blk_k, BM=bm, BN=bn, KC=kc, W=warps, KW=kwarps,
        LW=word_layout(bn, kc, warps, kwarps), LX=(act_word_layout if xw else act_layout)(bm, kc, warps, kwarps),
        UNIFORM=blk_n % bn == 0, EVEN_K=even, XW=xw, num_warps=warps * kwarps,
    )  # fmt: skip
    return y


def compile_offline(
    config: tuple[int, int, int, int, int, int],
    *,
    block_size: tuple[int, int] = (128, 128),
    x_dtype: str = "bf16",
    even_k: bool = True,
    prefetch: int = 2,
    capability: int = 90,
):
    """Compile `_gemv_kernel` for a CUDA target without a GPU (Triton's compiler and its bundled
    ptxas): the CompiledKernel, whose `asm` holds "ptx" and "cubin". What the tests read the
    instructions of; it fails to compile where a layout conversion would move data."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    bm, bn, kc, split, warps, kwarps = config
    names = "x_ptr q_ptr s_ptr y_ptr p_ptr cnt_ptr M N K k_per_group sxm sqn ssn ssk sym".split()
    xw = x_dtype == "bf16"
    types = ["*i32" if xw else f"*{x_dtype}", "*i32", "*fp32", f"*{x_dtype}", "*fp32", "*i32"] + ["i32"] * 9
    consts = dict(
        BLK_N=block_size[0], BLK_K=block_size[1], BM=bm, BN=bn, KC=kc, SPLIT=split, W=warps, KW=kwarps,
        LW=word_layout(bn, kc, warps, kwarps), LX=(act_word_layout if xw else act_layout)(bm, kc, warps, kwarps),
        UNIFORM=block_size[0] % bn == 0, EVEN_K=even_k, PREFETCH=prefetch, XW=xw,
    )  # fmt: skip
    signature = dict(zip(names, types, strict=True)) | {c: "constexpr" for c in consts}
    # what a launch specializes on: 16-byte aligned pointers, K and the row strides multiples of 16
    aligned = "x_ptr q_ptr s_ptr y_ptr p_ptr cnt_ptr K k_per_group sxm sqn sym".split()
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    src = GluonASTSource(_gemv_kernel, signature, consts, attrs=attrs)
    return triton.compile(
        src, target=GPUTarget("cuda", capability, 32), options=dict(num_warps=warps * kwarps)
    )


def compile_grouped_offline(
    config: tuple[int, int, int, int, int, int],
    *,
    x_dtype: str = "bf16",
    even_k: bool = True,
    capability: int = 90,
):
    """`compile_offline` for `_gemv_grouped_kernel` (128 x 128 weight blocks)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    bm, bn, kc, _split, warps, kwarps = config
    names = "x_ptr q_ptr s_ptr y_ptr off_ptr N K k_per_group sxm sqe sqn sse ssn ssk sym".split()
    xw = x_dtype == "bf16"
    types = ["*i32" if xw else f"*{x_dtype}", "*i32", "*fp32", f"*{x_dtype}", "*i32"] + ["i32"] * 10
    consts = dict(
        BLK_N=128, BLK_K=128, BM=bm, BN=bn, KC=kc, W=warps, KW=kwarps, LW=word_layout(bn, kc, warps, kwarps),
        LX=(act_word_layout if xw else act_layout)(bm, kc, warps, kwarps), UNIFORM=128 % bn == 0, EVEN_K=even_k,
        XW=xw,
    )  # fmt: skip
    signature = dict(zip(names, types, strict=True)) | {c: "constexpr" for c in consts}
    aligned = "x_ptr q_ptr s_ptr y_ptr off_ptr K k_per_group sxm sqe sqn sym".split()
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    src = GluonASTSource(_gemv_grouped_kernel, signature, consts, attrs=attrs)
    return triton.compile(
        src, target=GPUTarget("cuda", capability, 32), options=dict(num_warps=warps * kwarps)
    )
