"""Weight-only FP8 decode linear in Gluon (Triton's explicit-layout dialect): no shared memory.

`triton_fp8_gemv._gemv_kernel` lets Triton lay the weight tile out: the codes go through shared
memory (cp.async in, then one 2-byte `ld.shared` per two codes into the MMA operand layout), and
on the H200 its K loop issued ~7.3 instructions per weight element, which made it issue-bound at
18-32% of DRAM bandwidth (docs/benchmarks.md, M4, session 7). Here the layouts are written out so
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
get the same permutation as the B operand (n8 per MMA; every warp reads the whole x tile, which
stays in L1).

Numerics are `triton_fp8_gemv`'s: each weight is bf16(fp32(code) * scale) (`fp8_blockwise.dequantize`
to bf16, the trainer's weight), products exact in fp32, fp32 sums (here in mma.sync order), one
rounding to x's dtype. Split-K writes fp32 partials reduced in split order by the last program to
arrive (deterministic), as the Triton kernel does.

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
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma

from skyq.quant.kernels._common import cdiv, gemv_outputs

CHUNK = 64
"""K columns over which each thread's 16 contiguous codes are spread (four 16-column MMA steps)."""


def _bits(n: int) -> int:
    return n.bit_length() - 1


def _tile_layout(rows: int, kc: int, warps: int, cols: int, weights: bool) -> gl.DistributedLinearLayout:
    """A [rows, kc // cols] tile of elements holding `cols` K columns each (int32 words of four
    codes or two bf16, or single values): per thread 16 contiguous columns (one 16-byte load of codes,
    two of bf16) in registers, then further 64-column chunks; lanes take (t, g) = (lane % 4, lane //
    4), t the column group, g the row. Weights: rows g and g + 8 in registers, warps 16-row groups,
    then further 16*warps-row groups in registers: after the K permutation, the mma.sync (and
    warpgroup) A operand layout. Activations: rows g, g + 8, ... in registers, every warp a copy (the
    B operand of each warp's MMAs is the whole tile)."""
    reg = [[0, 1 << i] for i in range(_bits(16 // cols))]
    reg += [[8, 0]] if weights else []
    reg += [[0, CHUNK // cols << i] for i in range(_bits(kc // CHUNK))]
    if weights:
        reg += [[16 * warps << i, 0] for i in range(_bits(rows // (16 * warps)))]
        warp = [[16 << i, 0] for i in range(_bits(warps))]
    else:
        reg += [[8 << i, 0] for i in range(_bits(rows // 8))]
        warp = [[0, 0]] * _bits(warps)
    lane = [[0, 16 // cols], [0, 32 // cols], [1, 0], [2, 0], [4, 0]]
    return gl.DistributedLinearLayout(reg, lane, warp, [], [rows, kc // cols])


@functools.cache
def word_layout(bn: int, kc: int, warps: int) -> gl.DistributedLinearLayout:
    """The weight tile read as int32 words of four codes: [bn, kc // 4], 4 words a thread."""
    return _tile_layout(bn, kc, warps, 4, weights=True)


@functools.cache
def act_layout(bm: int, kc: int, warps: int) -> gl.DistributedLinearLayout:
    """The activation tile (fp32, or bf16 in odd strides) element by element: [bm, kc]."""
    return _tile_layout(bm, kc, warps, 1, weights=False)


@functools.cache
def act_word_layout(bm: int, kc: int, warps: int) -> gl.DistributedLinearLayout:
    """The bf16 activation tile read as int32 words of two columns: [bm, kc // 2]."""
    return _tile_layout(bm, kc, warps, 2, weights=False)


@functools.cache
def act_gather_layout(bm: int, kc: int, warps: int) -> gl.DistributedLinearLayout:
    """The [bm, kc // 2] activation words of `_gemv_wg_kernel` in MMA column order (word 8j + 4h + t
    of a 32-word chunk is memory word 8t + 2j + h), over all warps (no copies): per thread the four
    words t = 0..3 of one (row, j, h), i.e. 8 consecutive MMA columns (one 16-byte shared store);
    lanes take h, j (8 lanes read 32 contiguous bytes of a row: coalesced), then the chunk, then
    rows; warps and further registers take rows."""
    reg = [[0, 1], [0, 2]]
    lane = [[0, 4], [0, 8], [0, 16]]
    lane += [[0, 32]] if kc >= 128 else []
    rows = 1
    while len(lane) < 5:
        lane.append([rows, 0])
        rows *= 2
    warp = []
    for _ in range(_bits(warps)):
        warp.append([rows, 0])
        rows *= 2
    reg += [[0, 64 << i] for i in range(_bits(max(1, kc // 128)))]
    while rows < bm:
        reg.append([rows, 0])
        rows *= 2
    return gl.DistributedLinearLayout(reg, lane, warp, [], [bm, kc // 2])


_SPLIT2 = gl.constexpr("mov.b32 {$0, $1}, $2;")
"""One int32 word -> its two bf16 halves (low half first): no arithmetic, only register naming."""


@gluon.jit
def _mma_order(t, ROWS: gl.constexpr, KC: gl.constexpr):
    """[ROWS, KC] with memory column c*64 + 16t + 4j + 2h + i renamed MMA column c*64 + 16j + 8h + 2t + i."""
    return t.reshape([ROWS, KC // 64, 4, 4, 2, 2]).permute(0, 1, 3, 4, 2, 5).reshape([ROWS, KC])


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
def _load_codes(q_rows, s_ptrs, k0, K, ssk, rw, BLK_K: gl.constexpr, EVEN_K: gl.constexpr):
    """The code words and scale(s) of the KC columns from k0. Rows past N were clamped to the last
    row (read, never stored); columns past K are masked to zero."""
    if EVEN_K:
        words = gl.load(q_rows + (k0 // 4 + rw)[None, :])
    else:
        words = gl.load(q_rows + (k0 // 4 + rw)[None, :], mask=((k0 + 4 * rw) < K)[None, :], other=0)
    return words, gl.load(s_ptrs + (k0 // BLK_K) * ssk)


@gluon.jit
def _load_step(q_rows, x_rows, s_ptrs, k0, K, ssk, rw, rkx,
               BLK_K: gl.constexpr, EVEN_K: gl.constexpr, XW: gl.constexpr):  # fmt: skip
    """`_load_codes` and the activations (with XW, bf16 pairs as int32 words) of the KC columns
    from k0; rows past M clamped, columns past K masked to zero."""
    XPW: gl.constexpr = 2 if XW else 1  # activation columns per loaded element
    words, s = _load_codes(q_rows, s_ptrs, k0, K, ssk, rw, BLK_K, EVEN_K)
    if EVEN_K:
        xt = gl.load(x_rows + (k0 // XPW + rkx)[None, :])
    else:
        xt = gl.load(x_rows + (k0 // XPW + rkx)[None, :], mask=((k0 + XPW * rkx) < K)[None, :], other=0)
    return words, xt, s


@gluon.jit
def _load_step_or_zero(q_rows, x_rows, s_ptrs, k0, k_lo, k_hi, K, ssk, rw, rkx,
                       BLK_K: gl.constexpr, EVEN_K: gl.constexpr, XW: gl.constexpr):  # fmt: skip
    """`_load_step` at k0 if k0 < k_hi, else the split's first step with a zero scale."""
    valid = k0 < k_hi
    words, xt, s = _load_step(
        q_rows, x_rows, s_ptrs, gl.where(valid, k0, k_lo), K, ssk, rw, rkx, BLK_K, EVEN_K, XW
    )
    return words, xt, gl.where(valid, s, 0.0)


@gluon.jit
def _weight_operand(words, s, DA: gl.constexpr, BN: gl.constexpr, KC: gl.constexpr, UNIFORM: gl.constexpr):
    """The [BN, KC] bf16 A operand in MMA column order from the step's code words: bf16(fp32(code)
    * s) (e4m3 -> fp32 through fp16: exact, full-rate `cvt.rn.f16x2.e4m3x2`), in the registers the
    words were loaded into."""
    if UNIFORM:
        sc = gl.full(words.shape, s, gl.float32, layout=words.type.layout)
    else:
        sc = gl.broadcast(s[:, None], words)[0]
    e0, e1, e2, e3 = gl.inline_asm_elementwise(
        _DEQUANT4, "=h,=h,=h,=h,r,r", [words, sc],
        dtype=(gl.bfloat16, gl.bfloat16, gl.bfloat16, gl.bfloat16), is_pure=True, pack=1,
    )  # fmt: skip
    w = gl.join(gl.join(e0, e1), gl.join(e2, e3)).permute(0, 1, 3, 2).reshape([BN, KC])
    a = gl.convert_layout(_mma_order(w, BN, KC), DA, assert_trivial=True)
    return a


@gluon.jit
def _bf16_pairs(xw, BM: gl.constexpr, KC: gl.constexpr):
    """[BM, KC // 2] int32 words -> the [BM, KC] bf16 columns they hold (no data movement)."""
    lo, hi = gl.inline_asm_elementwise(
        _SPLIT2, "=h,=h,r", [xw], dtype=(gl.bfloat16, gl.bfloat16), is_pure=True, pack=1
    )
    return gl.join(lo, hi).reshape([BM, KC])


@gluon.jit
def _mma_step(words, xt, s, acc, DA: gl.constexpr, DB: gl.constexpr, BN: gl.constexpr, BM: gl.constexpr,
              KC: gl.constexpr, UNIFORM: gl.constexpr, XW: gl.constexpr):  # fmt: skip
    """acc += bf16(fp32(codes) * s) @ bf16(x)^T over the step's KC columns."""
    a = _weight_operand(words, s, DA, BN, KC, UNIFORM)
    if XW:
        xb = _bf16_pairs(xt, BM, KC)
    else:
        xb = xt.to(gl.bfloat16)
    b = gl.convert_layout(_mma_order(xb, BM, KC).permute(1, 0), DB, assert_trivial=True)
    return mma_v2(a, b, acc)


@gluon.jit
def _store_out(acc, MMA: gl.constexpr, y_ptr, p_ptr, cnt_ptr, M, N, sym, pid_n, pid_m, pid_s,
               BN: gl.constexpr, BM: gl.constexpr, SPLIT: gl.constexpr):  # fmt: skip
    """acc [BN, BM] (y^T of this tile) -> y; with SPLIT > 1 an fp32 partial, and the last program
    of the tile to arrive sums the partials in split order, writes y and resets its counter."""
    on = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, MMA))
    om = pid_m * BM + gl.arange(0, BM, layout=gl.SliceLayout(0, MMA))
    out_mask = (on < N)[:, None] & (om < M)[None, :]
    out_off = om[None, :].to(gl.int64) * sym + on[:, None]
    if SPLIT == 1:
        gl.store(y_ptr + out_off, acc.to(y_ptr.dtype.element_ty), mask=out_mask)
    else:
        mn = M * N
        gl.store(p_ptr + pid_s.to(gl.int64) * mn + out_off, acc, mask=out_mask)
        gl.thread_barrier()  # every thread's partial is stored before the release below
        tile = pid_m * gl.num_programs(0) + pid_n
        if gl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel") == SPLIT - 1:
            total = gl.zeros([BN, BM], gl.float32, layout=MMA)
            for i in gl.static_range(SPLIT):  # unrolled: all partial loads in flight; summed in split order
                total += gl.load(p_ptr + i * mn + out_off, mask=out_mask, other=0.0, cache_modifier=".cg")
            gl.store(y_ptr + out_off, total.to(y_ptr.dtype.element_ty), mask=out_mask)
            gl.atomic_xchg(cnt_ptr + tile, 0)


@gluon.jit
def _tile_pointers(x_ptr, q_ptr, s_ptr, M, N, K, k_per_split, sxm, sqn, ssn, pid_n, pid_m, pid_s,
                   BLK_N: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, XCOLS: gl.constexpr,
                   KC: gl.constexpr, LW: gl.constexpr, LX: gl.constexpr, UNIFORM: gl.constexpr):  # fmt: skip
    """A program's code-row, activation-row and scale pointers, its word and activation column
    offsets (XCOLS loaded elements a step) and its split's K range [k_lo, k_hi). Rows past N or M
    read the last row (in bounds, no mask in the K loop); their sums are not stored."""
    rn = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, LW))
    rw = gl.arange(0, KC // 4, layout=gl.SliceLayout(0, LW))
    rm = pid_m * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, LX))
    rkx = gl.arange(0, XCOLS, layout=gl.SliceLayout(0, LX))
    q_rows = q_ptr + gl.minimum(rn, N - 1)[:, None].to(gl.int64) * sqn
    x_rows = x_ptr + gl.minimum(rm, M - 1)[:, None].to(gl.int64) * sxm
    if UNIFORM:  # BN divides BLK_N: one scale row for the tile, a scalar per step
        s_ptrs = s_ptr + ((pid_n * BN) // BLK_N).to(gl.int64) * ssn
    else:  # each row its block's scale
        s_ptrs = s_ptr + (gl.minimum(rn, N - 1) // BLK_N).to(gl.int64) * ssn
    k_lo = pid_s * k_per_split
    return q_rows, x_rows, s_ptrs, rw, rkx, k_lo, gl.minimum(k_lo + k_per_split, K)


@gluon.jit
def _gemv_kernel(
    x_ptr, q_ptr, s_ptr, y_ptr, p_ptr, cnt_ptr,
    M, N, K, k_per_split,
    sxm, sqn, ssn, ssk, sym,
    BLK_N: gl.constexpr, BLK_K: gl.constexpr,
    BM: gl.constexpr, BN: gl.constexpr, KC: gl.constexpr, SPLIT: gl.constexpr, W: gl.constexpr,
    LW: gl.constexpr, LX: gl.constexpr, UNIFORM: gl.constexpr, EVEN_K: gl.constexpr, PREFETCH: gl.constexpr,
    XW: gl.constexpr,
):  # fmt: skip
    """y[m, n] (or split partials) = sum over this split's K range of bf16(q * s)[n, k] * x[m, k]
    with mma.sync; q (int32 words of four codes) and x (int32 pairs with XW) have unit stride along
    K. PREFETCH: how many steps' codes, activations and scales are loaded before a step's are
    converted and multiplied (0, 1, or 2 in ping-pong buffers)."""
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[W, 1], instr_shape=[16, 8])
    DA: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    DB: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
    pid_n = gl.program_id(0)
    pid_m = gl.program_id(1)
    pid_s = gl.program_id(2)
    q_rows, x_rows, s_ptrs, rw, rkx, k_lo, k_hi = _tile_pointers(
        x_ptr, q_ptr, s_ptr, M, N, K, k_per_split, sxm, sqn, ssn, pid_n, pid_m, pid_s,
        BLK_N, BM, BN, KC // 2 if XW else KC, KC, LW, LX, UNIFORM,
    )  # fmt: skip
    acc = gl.zeros([BN, BM], gl.float32, layout=MMA)
    if PREFETCH == 2:
        # Two steps in flight, ping-pong: each buffer is reloaded right after its MMA consumed it, so
        # no register moves. A step past the split's end loads its first step again (in bounds)
        # with scale 0: it adds exact zeros (finite x).
        a_w, a_x, a_s = _load_step(q_rows, x_rows, s_ptrs, k_lo, K, ssk, rw, rkx, BLK_K, EVEN_K, XW)
        b_w, b_x, b_s = _load_step_or_zero(
            q_rows, x_rows, s_ptrs, k_lo + KC, k_lo, k_hi, K, ssk, rw, rkx, BLK_K, EVEN_K, XW
        )
        for k0 in range(k_lo, k_hi, 2 * KC):
            acc = _mma_step(a_w, a_x, a_s, acc, DA, DB, BN, BM, KC, UNIFORM, XW)
            a_w, a_x, a_s = _load_step_or_zero(
                q_rows, x_rows, s_ptrs, k0 + 2 * KC, k_lo, k_hi, K, ssk, rw, rkx, BLK_K, EVEN_K, XW
            )
            acc = _mma_step(b_w, b_x, b_s, acc, DA, DB, BN, BM, KC, UNIFORM, XW)
            b_w, b_x, b_s = _load_step_or_zero(
                q_rows, x_rows, s_ptrs, k0 + 3 * KC, k_lo, k_hi, K, ssk, rw, rkx, BLK_K, EVEN_K, XW
            )
    elif PREFETCH == 1:  # the next step's loads issued before this step's math (values moved along)
        words, xt, s = _load_step(q_rows, x_rows, s_ptrs, k_lo, K, ssk, rw, rkx, BLK_K, EVEN_K, XW)
        for k0 in range(k_lo + KC, k_hi, KC):
            nxt_words, nxt_xt, nxt_s = _load_step(
                q_rows, x_rows, s_ptrs, k0, K, ssk, rw, rkx, BLK_K, EVEN_K, XW
            )
            acc = _mma_step(words, xt, s, acc, DA, DB, BN, BM, KC, UNIFORM, XW)
            words = nxt_words
            xt = nxt_xt
            s = nxt_s
        acc = _mma_step(words, xt, s, acc, DA, DB, BN, BM, KC, UNIFORM, XW)
    else:  # latency hidden by the other warps on the SM only
        for k0 in range(k_lo, k_hi, KC):
            words, xt, s = _load_step(q_rows, x_rows, s_ptrs, k0, K, ssk, rw, rkx, BLK_K, EVEN_K, XW)
            acc = _mma_step(words, xt, s, acc, DA, DB, BN, BM, KC, UNIFORM, XW)
    _store_out(acc, MMA, y_ptr, p_ptr, cnt_ptr, M, N, sym, pid_n, pid_m, pid_s, BN, BM, SPLIT)


@gluon.jit
def _load_x_mma_order(x_rows, k0, K, rkw, XPW: gl.constexpr, EVEN_K: gl.constexpr):
    """The activation words of the KC columns from k0, gathered straight into MMA column order (word
    8j + 4h + t of each 32-word chunk is memory word 8t + 2j + h): 4-byte loads, no permute after."""
    kw = (rkw // 32) * 32 + (rkw % 4) * 8 + ((rkw // 8) % 4) * 2 + (rkw // 4) % 2
    if EVEN_K:
        return gl.load(x_rows + (k0 // XPW + kw)[None, :])
    return gl.load(x_rows + (k0 // XPW + kw)[None, :], mask=((k0 + XPW * kw) < K)[None, :], other=0)


@gluon.jit
def _wg_step(words, xw, s, acc, x_smem, DA: gl.constexpr, BN: gl.constexpr, BM: gl.constexpr,
             KC: gl.constexpr, UNIFORM: gl.constexpr):  # fmt: skip
    """acc += bf16(fp32(codes) * s) @ x^T through one warpgroup MMA: the weights from registers
    (the mma.sync operand layout, the same per warp), x^T from shared memory, written here."""
    a = _weight_operand(words, s, DA, BN, KC, UNIFORM)
    xb = _bf16_pairs(xw, BM, KC)
    gl.thread_barrier()  # the previous step's MMA has read x_smem (it completed in every warp)
    x_smem.store(xb)
    fence_async_shared()
    gl.thread_barrier()  # every warp's part of x is in shared memory
    return warpgroup_mma(a, x_smem.permute((1, 0)), acc)  # x^T: K-major B


@gluon.jit
def _gemv_wg_kernel(
    x_ptr, q_ptr, s_ptr, y_ptr, p_ptr, cnt_ptr,
    M, N, K, k_per_split,
    sxm, sqn, ssn, ssk, sym,
    BLK_N: gl.constexpr, BLK_K: gl.constexpr,
    BM: gl.constexpr, BN: gl.constexpr, KC: gl.constexpr, SPLIT: gl.constexpr, W: gl.constexpr,
    LW: gl.constexpr, LX: gl.constexpr, UNIFORM: gl.constexpr, EVEN_K: gl.constexpr, PREFETCH: gl.constexpr,
):  # fmt: skip
    """`_gemv_kernel`'s product for more batch rows, with Hopper's warpgroup MMA (one warpgroup, W
    == 4): the codes as there (16-byte loads into the operand registers), the bf16 activations
    (as int32 pairs) gathered in MMA column order by all warps once, stored to shared memory as the
    B operand; with PREFETCH, one step loaded ahead of the math. With mma.sync each weight code
    costs BM / 64 MMA instructions (one at 64 rows: the tensor cores' mma.sync rate at full memory
    speed) and every warp reads the whole activation tile; this reads it once per program. Still
    slower than the Triton kernel at 64 rows on the H200 (q/k/v 16.7 vs 13.9 us) and level at 16-32:
    each step's MMA is synchronous (its latency exposed), the gather costs 4-byte loads, shared
    stores and two barriers per step, and the split-K partials grow with the rows."""
    MMA: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[W, 1], instr_shape=[16, BM, 16]
    )
    DA: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    XS: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    x_smem = gl.allocate_shared_memory(gl.bfloat16, [BM, KC], XS)
    pid_n = gl.program_id(0)
    pid_m = gl.program_id(1)
    pid_s = gl.program_id(2)
    q_rows, x_rows, s_ptrs, rw, rkw, k_lo, k_hi = _tile_pointers(
        x_ptr, q_ptr, s_ptr, M, N, K, k_per_split, sxm, sqn, ssn, pid_n, pid_m, pid_s,
        BLK_N, BM, BN, KC // 2, KC, LW, LX, UNIFORM,
    )  # fmt: skip
    acc = gl.zeros([BN, BM], gl.float32, layout=MMA)
    if PREFETCH:
        words, s = _load_codes(q_rows, s_ptrs, k_lo, K, ssk, rw, BLK_K, EVEN_K)
        xw = _load_x_mma_order(x_rows, k_lo, K, rkw, 2, EVEN_K)
        for k0 in range(k_lo + KC, k_hi, KC):
            nxt_words, nxt_s = _load_codes(q_rows, s_ptrs, k0, K, ssk, rw, BLK_K, EVEN_K)
            nxt_xw = _load_x_mma_order(x_rows, k0, K, rkw, 2, EVEN_K)
            acc = _wg_step(words, xw, s, acc, x_smem, DA, BN, BM, KC, UNIFORM)
            words = nxt_words
            xw = nxt_xw
            s = nxt_s
        acc = _wg_step(words, xw, s, acc, x_smem, DA, BN, BM, KC, UNIFORM)
    else:
        for k0 in range(k_lo, k_hi, KC):
            words, s = _load_codes(q_rows, s_ptrs, k0, K, ssk, rw, BLK_K, EVEN_K)
            xw = _load_x_mma_order(x_rows, k0, K, rkw, 2, EVEN_K)
            acc = _wg_step(words, xw, s, acc, x_smem, DA, BN, BM, KC, UNIFORM)
    _store_out(acc, MMA, y_ptr, p_ptr, cnt_ptr, M, N, sym, pid_n, pid_m, pid_s, BN, BM, SPLIT)


def supports(block_size: tuple[int, int]) -> bool:
    """Weight blocks this kernel tiles: any row count, a power-of-two column count >= 64 (a K step
    of KC <= BLK_K columns then has one scale per row)."""
    bn, bk = block_size
    return bn > 0 and bk >= CHUNK and bk & (bk - 1) == 0


def tiling(m: int, n: int, k: int, block_k: int, sms: int) -> tuple[int, int, int, int, int]:
    """(BM, BN, KC, split, warps): the batch padded to the MMA's 8 columns (at most 64 per tile),
    weight rows on 4 warps, 64 of them per program (128 where 64-row tiles alone already give ~1.2
    programs per SM), 128-column steps (<= the scale block), K split in powers of two up to 16
    while there are fewer programs than ~2.9 per SM (~1.9 at more than 8 batch rows, whose split
    partials cost more) and each split keeps >= 2 steps. From the H200 sweep of the fused model's
    shapes (benchmarks/decode.py --gluon; docs/benchmarks.md, M4, session 8): at one row the 2048 x
    4096 o projection 6.8 -> 6.4 us with split 16 over 8, the 12288 x 2048 gate/up 11.2 -> 10.4 us
    with 128-row tiles split 4 over 64-row tiles split 2."""
    bm = min(64, max(8, triton.next_power_of_2(m)))
    rows = cdiv(m, bm)
    bn, warps = (128 if cdiv(n, 64) * rows >= 1.2 * sms else 64), 4
    kc = min(128, block_k)
    tiles = cdiv(n, bn) * rows
    steps = cdiv(k, kc)
    target = (2.9 if bm <= 8 else 1.9) * sms
    split = 1
    while split < 16 and tiles * split < target and steps >= 4 * split:
        split *= 2
    return bm, bn, kc, split, warps


def linear(
    x: Tensor,
    q: Tensor,
    scale_inv: Tensor,
    *,
    block_size: tuple[int, int],
    sms: int,
    counters,
    config: tuple[int, int, int, int, int] | None = None,
    prefetch: int = 1,
    wgmma: bool = False,
) -> Tensor:
    """y [..., N] in x's dtype for x [..., K] (bf16 or fp32 values), q e4m3 [N, K] with unit
    stride along K, scale_inv fp32 [ceil(N/bn), ceil(K/bk)]; `supports(block_size)` holds. No host
    sync. `counters(device, tiles)`: a zeroed int32 buffer the split launches leave zeroed.
    `config` (BM, BN, KC, split, warps) for sweeps; by default `tiling`. `prefetch`: steps
    loaded ahead of the math: 0, 1 (the next, values moved along; the default: fastest or within
    5% in most cells of the H200 sweep), 2 (two, ping-pong buffers: no moves, more registers; it
    spills at 32+ batch rows of 128-column steps). `wgmma`: `_gemv_wg_kernel` instead (bf16 x,
    Hopper; 4 warps, prefetch 0 or 1), a sweep variant: on the H200 it lost to the Triton kernel at
    64 rows in every fused shape (q/k/v 16.7 vs 13.9 us), came within 2-7% at 32 and level with the
    mma.sync kernel at 16 (docs/benchmarks.md, M4, session 8)."""
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m, k = x2.shape
    n = q.shape[0]
    blk_n, blk_k = block_size
    bm, bn, kc, split, warps = config or tiling(m, n, k, blk_k, sms)
    if bn % (16 * warps) or kc % CHUNK or blk_k % kc or bm < 8:
        raise ValueError(
            f"gluon fp8 gemv: config {(bm, bn, kc, split, warps)} does not tile block {block_size}"
        )
    steps = cdiv(cdiv(k, kc), split)
    k_per_split = (steps + (steps % 2 if prefetch == 2 else 0)) * kc  # whole ping-pong pairs
    split = cdiv(k, k_per_split)
    words = q.view(torch.int32)  # four codes per word (K % 4 == 0, rows 4-byte aligned)
    # bf16 activations as int32 pairs: carried across the prefetch as whole registers
    xw = x2.dtype == torch.bfloat16 and k % 2 == 0 and x2.stride(0) % 2 == 0 and x2.storage_offset() % 2 == 0
    xin = x2.view(torch.int32) if xw else x2
    if wgmma and (not xw or warps != 4 or prefetch > 1):
        raise ValueError(
            "gluon fp8 gemv: the warpgroup kernel takes bf16 x (even K), 4 warps, prefetch 0 or 1"
        )
    grid = (cdiv(n, bn), cdiv(m, bm), split)
    y, part, cnt = gemv_outputs(x, m, n, grid, counters)
    args = (xin, words, scale_inv, y, part, cnt, m, n, k, k_per_split,
            xin.stride(0), words.stride(0), *scale_inv.stride(), y.stride(0))  # fmt: skip
    shape = dict(BLK_N=blk_n, BLK_K=blk_k, BM=bm, BN=bn, KC=kc, SPLIT=split, W=warps, LW=word_layout(bn, kc, warps),
                 UNIFORM=blk_n % bn == 0, EVEN_K=k % kc == 0, PREFETCH=prefetch, num_warps=warps)  # fmt: skip
    if wgmma:
        _gemv_wg_kernel[grid](*args, **shape, LX=act_gather_layout(bm, kc, warps))
    else:
        _gemv_kernel[grid](*args, **shape, LX=(act_word_layout if xw else act_layout)(bm, kc, warps), XW=xw)
    return y.reshape(*x.shape[:-1], n)


def compile_offline(
    config: tuple[int, int, int, int, int],
    *,
    block_size: tuple[int, int] = (128, 128),
    x_dtype: str = "bf16",
    even_k: bool = True,
    prefetch: int = 2,
    capability: int = 90,
    wgmma: bool = False,
):
    """Compile `_gemv_kernel` for a CUDA target without a GPU (Triton's compiler and its bundled
    ptxas): the CompiledKernel, whose `asm` holds "ptx" and "cubin". What the tests read the
    instructions of; it fails to compile where a layout conversion would move data."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    bm, bn, kc, split, warps = config
    names = "x_ptr q_ptr s_ptr y_ptr p_ptr cnt_ptr M N K k_per_split sxm sqn ssn ssk sym".split()
    xw = x_dtype == "bf16"
    types = ["*i32" if xw else f"*{x_dtype}", "*i32", "*fp32", f"*{x_dtype}", "*fp32", "*i32"] + ["i32"] * 9
    consts = dict(
        BLK_N=block_size[0], BLK_K=block_size[1], BM=bm, BN=bn, KC=kc, SPLIT=split, W=warps,
        LW=word_layout(bn, kc, warps), LX=(act_word_layout if xw else act_layout)(bm, kc, warps),
        UNIFORM=block_size[0] % bn == 0, EVEN_K=even_k, PREFETCH=prefetch, XW=xw,
    )  # fmt: skip
    signature = dict(zip(names, types, strict=True)) | {c: "constexpr" for c in consts}
    # what a launch specializes on: 16-byte aligned pointers, K and the row strides multiples of 16
    aligned = "x_ptr q_ptr s_ptr y_ptr p_ptr cnt_ptr K k_per_split sxm sqn sym".split()
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    if wgmma:
        consts.pop("XW")
        consts["LX"] = act_gather_layout(bm, kc, warps)
        signature.pop("XW")
    src = GluonASTSource(_gemv_wg_kernel if wgmma else _gemv_kernel, signature, consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", capability, 32), options=dict(num_warps=warps))
