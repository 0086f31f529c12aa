"""Weight-only decode linears in Gluon for formats with per-row group scales: compressed-tensors'
INT4 `pack-quantized` words and MXFP8 (e4m3 codes, one ue8m0 scale a row and 32 columns), laid out
as `gluon_fp8_gemv`'s kernel lays out FP8 codes.

`triton_int4_gemv.linear` / `linear_grouped` route INT4 here on devices of compute capability >= 9
(`triton_int4_gemv.GLUON`); `int4_mxfp8_linear.mxfp8_weight_only_linear` / `mxfp8_grouped_weight_only_linear`
route MXFP8 here on devices of compute capability >= 8.9 (its e4m3 conversion).

`triton_int4_gemv` leaves the layout to Triton, which sends the dequantized tile through shared memory
to reach the MMA operand (the profile is in docs/benchmarks.md, M4). Here each
thread loads the int32 words of its own `mma.sync` A fragments, exactly as the FP8 Gluon kernel loads
its codes: per 64-column chunk a thread holds the 16 contiguous columns 16t .. 16t + 15 (two INT4
words of eight codes, or four MXFP8 words of four), K permuted inside the chunk for both operands
(`gluon_fp8_gemv._mma_order`). Each word becomes its bf16 weights in registers, joined in column
order: after the reshape the tile has the FP8 kernel's register layout, so the operand conversion
moves no data (`assert_trivial`).
- INT4 (`_DEQUANT8`): nibbles j and j + 4 ORed into bf16 128, minus 136, times the bf16 scale pair,
  4 instructions a pair: the bits of `int4.dequantize_packed`.
- MXFP8 (`gluon_fp8_gemv._DEQUANT4`): e4m3 -> fp16 -> fp32 (exact), times 2^(e - 127) in fp32
  (exact), rounded once to bf16: the bits of `mxfp8.dequantize` to bf16.

Scales: one a row and group of G columns (G a multiple of the word's codes), loaded per word. A
thread's 16 columns of a chunk lie in one 32-column MXFP8 group.
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
from skyq.rollout.kernels.gluon_fp8_gemv import (
    _DEQUANT4,
    CHUNK,
    _bf16_pairs,
    _load_x,
    _mma_order,
    _store_out,
    _tile_layout,
    act_layout,
    act_word_layout,
    launch_shape,
)

INT4_CODES = 8
"""INT4 codes an int32 word."""

MX_CODES = 4
"""MXFP8 (e4m3) codes an int32 word."""

MX_GROUP = 32
"""Columns an MXFP8 scale covers."""


@functools.cache
def word_layout(
    bn: int, kc: int, warps: int, kw: int = 1, cpw: int = INT4_CODES
) -> gl.DistributedLinearLayout:
    """The weight tile as int32 words of `cpw` codes: [kw, bn, kc // cpw], 16 columns a thread a
    chunk."""
    return _tile_layout(bn, kc, warps, cpw, weights=True, kw=kw)


_DEQUANT8 = gl.constexpr("""{
.reg .b32 t0, t1, t2, t3, c, s;
mov.b32 c, 0x43084308;
mov.b32 s, $9;
lop3.b32 t0, $8, 0x000F000F, 0x43004300, 0xEA;
shr.u32 t1, $8, 4;
lop3.b32 t1, t1, 0x000F000F, 0x43004300, 0xEA;
shr.u32 t2, $8, 8;
lop3.b32 t2, t2, 0x000F000F, 0x43004300, 0xEA;
shr.u32 t3, $8, 12;
lop3.b32 t3, t3, 0x000F000F, 0x43004300, 0xEA;
sub.rn.bf16x2 t0, t0, c;
sub.rn.bf16x2 t1, t1, c;
sub.rn.bf16x2 t2, t2, c;
sub.rn.bf16x2 t3, t3, c;
mul.rn.bf16x2 t0, t0, s;
mul.rn.bf16x2 t1, t1, s;
mul.rn.bf16x2 t2, t2, s;
mul.rn.bf16x2 t3, t3, s;
mov.b32 {$0, $4}, t0;
mov.b32 {$1, $5}, t1;
mov.b32 {$2, $6}, t2;
mov.b32 {$3, $7}, t3;
}""")
"""One word of eight codes (nibble j = column 8w + j) and its scale twice in one register -> the eight
bf16(code * scale), column order: (w >> 4j) & 0x000F000F | 0x43004300 holds nibbles j and j + 4 as bf16
128 + nibble (exact), minus 136 the signed codes (exact), times the scale pair (one rounding of an exact
product)."""


@gluon.jit
def _weight_operand(words, s, DA: gl.constexpr, KW: gl.constexpr, BN: gl.constexpr, KC: gl.constexpr,
                    MX: gl.constexpr):  # fmt: skip
    """The [KW, BN, KC] bf16 A operand in MMA column order, in the registers the words were loaded
    into; s the words' scales (INT4: bf16 pairs; MX: fp32)."""
    if MX:
        e0, e1, e2, e3 = gl.inline_asm_elementwise(
            _DEQUANT4, "=h,=h,=h,=h,r,r", [words, s], dtype=(gl.bfloat16,) * 4, is_pure=True, pack=1
        )
        w = gl.join(gl.join(e0, e1), gl.join(e2, e3)).permute(0, 1, 2, 4, 3).reshape([KW, BN, KC])
    else:
        e0, e1, e2, e3, e4, e5, e6, e7 = gl.inline_asm_elementwise(
            _DEQUANT8, "=h,=h,=h,=h,=h,=h,=h,=h,r,r", [words, s],
            dtype=(gl.bfloat16,) * 8, is_pure=True, pack=1,
        )  # fmt: skip
        lo = gl.join(gl.join(e0, e1), gl.join(e2, e3))
        hi = gl.join(gl.join(e4, e5), gl.join(e6, e7))
        # dims (..., b0, b1, b2) with column 4 b2 + 2 b1 + b0: reversed to column order
        w = gl.join(lo, hi).permute(0, 1, 2, 5, 4, 3).reshape([KW, BN, KC])
    return gl.convert_layout(_mma_order(w, KW, BN, KC), DA, assert_trivial=True)


@gluon.jit
def _load_words(p_rows, s_rows, k0, K, rw, kcw, G: gl.constexpr, EVEN_K: gl.constexpr, CPW: gl.constexpr,
                MX: gl.constexpr):  # fmt: skip
    """The words [KW, BN, KC // CPW] of each K group's columns from k0 (evict-first: read once) and
    each word's scale (INT4: the bf16 scale twice in one register; MX: 2^(e - 127) in fp32, the
    subnormal 2^-127 for e = 0); words past K are zero (their weights 0)."""
    if EVEN_K:
        words = gl.load(p_rows + (k0 // CPW + rw), eviction_policy="evict_first")
        s = gl.load(s_rows + (kcw + k0) // G)
    else:
        ok = (kcw + k0) < K
        words = gl.load(p_rows + (k0 // CPW + rw), mask=ok, other=0, eviction_policy="evict_first")
        s = gl.load(s_rows + (kcw + k0) // G, mask=ok, other=0)
    if MX:
        e = s.to(gl.int32)
        sc = gl.where(e == 0, 0x00400000, e << 23).to(gl.float32, bitcast=True)
    else:
        bits = s.to(gl.int16, bitcast=True).to(gl.int32) & 0xFFFF
        sc = bits | (bits << 16)
    return words, sc


@gluon.jit
def _step(p_rows, s_rows, x_rows, k0, K, rw, kcw, rkx, kcx, G: gl.constexpr, EVEN_K: gl.constexpr,
          CPW: gl.constexpr, MX: gl.constexpr):  # fmt: skip
    words, s = _load_words(p_rows, s_rows, k0, K, rw, kcw, G, EVEN_K, CPW, MX)
    return words, s, _load_x(x_rows, k0, K, rkx, kcx, EVEN_K, True)


@gluon.jit
def _mma(words, s, xt, acc, DA: gl.constexpr, DB: gl.constexpr, KW: gl.constexpr, BN: gl.constexpr,
         BM: gl.constexpr, KC: gl.constexpr, MX: gl.constexpr):  # fmt: skip
    a = _weight_operand(words, s, DA, KW, BN, KC, MX)
    b = gl.convert_layout(
        _mma_order(_bf16_pairs(xt, KW, BM, KC), KW, BM, KC).permute(0, 2, 1), DB, assert_trivial=True
    )
    return mma_v2(a, b, acc)


@gluon.jit
def _tile(x_ptr, p_ptr, s_ptr, M, N, K, k_per_group, sxm, spn, ssn, pid_n, pid_m, pid_s, acc,
          DA: gl.constexpr, DB: gl.constexpr, G: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr,
          KC: gl.constexpr, KW: gl.constexpr, LW: gl.constexpr, LX: gl.constexpr, EVEN_K: gl.constexpr,
          CPW: gl.constexpr, MX: gl.constexpr):  # fmt: skip
    """acc + this program's K groups' sums for weight rows pid_n * BN.. and activation rows pid_m *
    BM..; the next step's loads issued before this step's math. Rows past N or M read the last row."""
    LW2: gl.constexpr = gl.SliceLayout(2, LW)
    LX2: gl.constexpr = gl.SliceLayout(2, LX)
    rn = gl.minimum(pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, LW2)), N - 1)
    kbw = (pid_s * KW + gl.arange(0, KW, layout=gl.SliceLayout(1, LW2))) * k_per_group
    rw = gl.arange(0, KC // CPW, layout=gl.SliceLayout(0, gl.SliceLayout(1, LW)))[None, None, :]
    rm = gl.minimum(pid_m * BM + gl.arange(0, BM, layout=gl.SliceLayout(0, LX2)), M - 1)
    kbx = (pid_s * KW + gl.arange(0, KW, layout=gl.SliceLayout(1, LX2))) * k_per_group
    rkx = gl.arange(0, KC // 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, LX)))[None, None, :]
    p_rows = p_ptr + rn[None, :, None].to(gl.int64) * spn + (kbw // CPW)[:, None, None]
    s_rows = s_ptr + rn[None, :, None].to(gl.int64) * ssn
    x_rows = x_ptr + rm[None, :, None].to(gl.int64) * sxm + (kbx // 2)[:, None, None]
    kcw = kbw[:, None, None] + CPW * rw
    kcx = kbx[:, None, None] + 2 * rkx
    words, s, xt = _step(p_rows, s_rows, x_rows, 0, K, rw, kcw, rkx, kcx, G, EVEN_K, CPW, MX)
    for k0 in range(KC, k_per_group, KC):
        nxt_words, nxt_s, nxt_xt = _step(p_rows, s_rows, x_rows, k0, K, rw, kcw, rkx, kcx, G, EVEN_K, CPW, MX)
        acc = _mma(words, s, xt, acc, DA, DB, KW, BN, BM, KC, MX)
        words = nxt_words
        s = nxt_s
        xt = nxt_xt
    return _mma(words, s, xt, acc, DA, DB, KW, BN, BM, KC, MX)


@gluon.jit
def _wo_kernel(
    x_ptr, p_ptr, s_ptr, y_ptr, part_ptr, cnt_ptr,
    M, N, K, k_per_group,
    sxm, spn, ssn, sym,
    G: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, KC: gl.constexpr, SPLIT: gl.constexpr,
    W: gl.constexpr, KW: gl.constexpr, LW: gl.constexpr, LX: gl.constexpr, EVEN_K: gl.constexpr,
    CPW: gl.constexpr, MX: gl.constexpr,
):  # fmt: skip
    """y[m, n] (or split partials) = sum over this split's K range of bf16(code * scale)[n, k] * x[m, k];
    x as int32 pairs of bf16, the words (CPW codes each; MX: e4m3, else INT4) and scales of unit
    stride along K. W warps the tile's rows, KW groups of them parts of the split's K range, summed
    in the program (`_store_out`)."""
    MMA: gl.constexpr = gl.NVMMADistributedLayout(
        version=[2, 0], warps_per_cta=[KW, W, 1], instr_shape=[1, 16, 8]
    )
    DA: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    DB: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
    pid_n = gl.program_id(0)
    pid_m = gl.program_id(1)
    pid_s = gl.program_id(2)
    acc = gl.zeros([KW, BN, BM], gl.float32, layout=MMA)
    acc = _tile(x_ptr, p_ptr, s_ptr, M, N, K, k_per_group, sxm, spn, ssn, pid_n, pid_m, pid_s, acc,
                DA, DB, G, BM, BN, KC, KW, LW, LX, EVEN_K, CPW, MX)  # fmt: skip
    _store_out(acc, MMA, y_ptr, part_ptr, cnt_ptr, M, N, sym, pid_n, pid_m, pid_s, BN, BM, SPLIT)


@gluon.jit
def _wo_grouped_kernel(
    x_ptr, p_ptr, s_ptr, y_ptr, off_ptr,
    N, K, k_per_group,
    sxm, spe, spn, sse, ssn, sym,
    G: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, KC: gl.constexpr,
    W: gl.constexpr, KW: gl.constexpr, LW: gl.constexpr, LX: gl.constexpr, EVEN_K: gl.constexpr,
    CPW: gl.constexpr, MX: gl.constexpr,
):  # fmt: skip
    """Grouped form: program (n, e) takes N tile n of expert e's weight and the expert's rows
    off[e]:off[e + 1], BM at a time (no split). An expert without rows reads nothing."""
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
    p_e = p_ptr + e.to(gl.int64) * spe
    s_e = s_ptr + e.to(gl.int64) * sse
    for mt in range(0, gl.cdiv(rows, BM)):
        acc = gl.zeros([KW, BN, BM], gl.float32, layout=MMA)
        acc = _tile(x_e, p_e, s_e, rows, N, K, k_per_group, sxm, spn, ssn, pid_n, mt, 0, acc,
                    DA, DB, G, BM, BN, KC, KW, LW, LX, EVEN_K, CPW, MX)  # fmt: skip
        _store_out(acc, MMA, y_e, y_e, off_ptr, rows, N, sym, pid_n, mt, 0, BN, BM, 1)


def supports(group_size: int, k: int) -> bool:
    """INT4: groups of whole words dividing K, K a whole number of words and of bf16 pairs."""
    return k % 8 == 0 and group_size % 8 == 0 and group_size > 0 and k % group_size == 0


def supports_mxfp8(q: Tensor) -> bool:
    """MXFP8 codes [..., N, K] the kernels read as int32 words: K a whole number of 32-column scale
    groups, unit stride along K, rows (and experts) and the start 4-byte aligned."""
    return (
        q.shape[-1] % MX_GROUP == 0 and q.stride(-1) == 1 and q.storage_offset() % 4 == 0
        and all(st % 4 == 0 for st in q.stride()[:-1])
    )  # fmt: skip


def tiling(m: int, n: int, k: int, sms: int, mx: bool = False) -> tuple[int, int, int, int, int, int]:
    """(BM, BN, KC, split, warps, kwarps) of a dense launch, tuned on the H200 sweep of the fused
    dense shapes at 1-64 rows (`benchmarks/decode.py --only int4-sweep` / `--only mxfp8-sweep`;
    docs/benchmarks.md, M4, "The decode kernels' tuning rules"):
    - 32 weight rows a warp where that still gives >= 2 tiles an SM, except at 9-16 rows (where 16
      won on the fused gate/up), else 16; MXFP8 (twice INT4's words a thread) only above 16 rows;
    - up to 16 rows, `gluon_fp8_gemv.tiling`'s K warps and split, the batch in one tile of 8 or 16
      rows (two 8-row tiles lost for INT4, whose dequantization costs more than FP8's);
    - above 16 rows, tiles of 32 rows (the dequantized weights serve 32 rows; 8- and 16-row tiles
      re-dequantize them, taking twice as long or more) and K warps while twice them stay within 8 warps
      an SM, no split (the best or close to it in every cell at 32 and 64 rows)."""
    kc = 128
    bn = 32 if cdiv(n, 32) >= 2 * sms and (m > 16 or (m <= 8 and not mx)) else 16
    weight_tiles = cdiv(n, bn)
    steps = cdiv(k, kc)
    kwarps = 1
    if m > 16:
        tiles = weight_tiles * cdiv(m, 32)
        while kwarps < 8 and 2 * tiles * kwarps <= 8 * sms and steps >= 8 * kwarps:
            kwarps *= 2
        return 32, bn, kc, 1, 1, kwarps
    bm = 8 if m <= 8 else 16
    while kwarps < 16 and weight_tiles * kwarps < 7.5 * sms and steps >= 4 * kwarps:
        kwarps *= 2
    split = 1
    while split < 16 and weight_tiles * split < 0.5 * sms and steps >= 4 * kwarps * split:
        split *= 2
    return bm, bn, kc, split, 1, kwarps


def grouped_tiling(
    rows: int, experts: int, n: int, k: int, sms: int, mx: bool = False
) -> tuple[int, int, int, int, int, int]:
    """(BM, BN, KC, split, warps, kwarps) of a grouped launch: `gluon_fp8_gemv.grouped_tiling`'s row
    tiles (8, 16 or 32 by the mean rows an expert), 32 weight rows a warp, and with 8-row tiles the
    K range on up to 4 warps while the active experts' tiles (taken to be min(experts, rows)) give
    fewer than 15 warps an SM (16- and 32-row tiles lost with more). MXFP8 with 8-row tiles: the 32
    weight rows on two warps and at most 2 K warps. Tuned on the H200 sweep of Qwen3-30B-A3B's and
    small_moe's fused gate/up and down at 1-256 tokens (`--only int4-sweep` / `--only mxfp8-sweep`;
    docs/benchmarks.md, M4, "The decode kernels' tuning rules"), where it is the best or close to it but for one cell, named there."""
    bm = 8 if rows <= 6 * experts else 16 if rows <= 12 * experts else 32
    kc, bn = 128, 32
    tiles = cdiv(n, bn) * max(1, min(experts, rows))
    steps = cdiv(k, kc)
    kwarps = 1
    while bm == 8 and kwarps < 4 and tiles * kwarps < 15 * sms and steps >= 4 * kwarps:
        kwarps *= 2
    if mx and bm == 8:
        return bm, bn, kc, 1, 2, min(kwarps, 2)
    return bm, bn, kc, 1, 1, kwarps


def _dense(x: Tensor, words: Tensor, scale: Tensor, n: int, group: int, cpw: int, mx: bool, sms: int, counters,
           config: tuple[int, int, int, int, int, int] | None) -> Tensor:  # fmt: skip
    x2 = x if x.stride(-1) == 1 else x.contiguous()
    m, k = x2.shape
    bm, bn, kc, split, warps, kwarps = config or tiling(m, n, k, sms, mx)
    if m == 0 or n == 0:
        return torch.empty((m, n), dtype=x.dtype, device=x.device)
    if bn % (16 * warps) or kc % CHUNK or bm < 8 or kwarps & (kwarps - 1):
        raise ValueError(f"gluon weight-only gemv: config {(bm, bn, kc, split, warps, kwarps)} does not tile")
    k_per_group, split, even = launch_shape(k, kc, split, kwarps)
    xin = x2.view(torch.int32)
    grid = (cdiv(n, bn), cdiv(m, bm), split)
    y, part, cnt = gemv_outputs(x2, m, n, grid, counters)
    _wo_kernel[grid](
        xin, words, scale, y, part, cnt, m, n, k, k_per_group,
        xin.stride(0), words.stride(0), scale.stride(0), y.stride(0),
        G=group, BM=bm, BN=bn, KC=kc, SPLIT=split, W=warps, KW=kwarps,
        LW=word_layout(bn, kc, warps, kwarps, cpw), LX=act_word_layout(bm, kc, warps, kwarps), EVEN_K=even,
        CPW=cpw, MX=mx, num_warps=warps * kwarps,
    )  # fmt: skip
    return y


def _grouped(x: Tensor, words: Tensor, scale: Tensor, offsets: Tensor, n: int, group: int, cpw: int, mx: bool,
             sms: int, config: tuple[int, int, int, int, int, int] | None) -> Tensor:  # fmt: skip
    x2 = x if x.stride(-1) == 1 else x.contiguous()
    t, k = x2.shape
    e = words.shape[0]
    bm, bn, kc, _split, warps, kwarps = config or grouped_tiling(t, e, n, k, sms, mx)
    k_per_group, _, even = launch_shape(k, kc, 1, kwarps)
    xin = x2.view(torch.int32)
    y = torch.empty((t, n), dtype=x.dtype, device=x.device)
    if t == 0 or n == 0 or e == 0:
        return y
    _wo_grouped_kernel[(cdiv(n, bn), e)](
        xin, words, scale, y, offsets, n, k, k_per_group,
        xin.stride(0), words.stride(0), words.stride(1), scale.stride(0), scale.stride(1), y.stride(0),
        G=group, BM=bm, BN=bn, KC=kc, W=warps, KW=kwarps, LW=word_layout(bn, kc, warps, kwarps, cpw),
        LX=act_word_layout(bm, kc, warps, kwarps), EVEN_K=even, CPW=cpw, MX=mx, num_warps=warps * kwarps,
    )  # fmt: skip
    return y


def linear(x: Tensor, packed: Tensor, scale: Tensor, *, group_size: int, sms: int, counters,
           config: tuple[int, int, int, int, int, int] | None = None) -> Tensor:  # fmt: skip
    """INT4: y [M, N] in x's dtype for bf16 x [M, K], packed int32 [N, K/8], bf16 scale [N, K/G]."""
    return _dense(x, packed, scale, packed.shape[0], group_size, INT4_CODES, False, sms, counters, config)


def linear_grouped(x: Tensor, packed: Tensor, scale: Tensor, offsets: Tensor, *, group_size: int, sms: int,
                   config: tuple[int, int, int, int, int, int] | None = None) -> Tensor:  # fmt: skip
    """INT4: y [T, N] for bf16 x [T, K] (rows sorted by expert), packed int32 [E, N, K/8], bf16 scale
    [E, N, K/G], offsets int32 [E + 1] on the device. No host sync."""
    return _grouped(x, packed, scale, offsets, packed.shape[1], group_size, INT4_CODES, False, sms, config)


def linear_mxfp8(x: Tensor, q: Tensor, scale_u8: Tensor, *, sms: int, counters,
                 config: tuple[int, int, int, int, int, int] | None = None) -> Tensor:  # fmt: skip
    """MXFP8: y [M, N] in x's dtype for bf16 x [M, K], e4m3 q [N, K] (`supports_mxfp8`), uint8
    scales [N, K/32] of unit stride along K."""
    return _dense(
        x, q.view(torch.int32), scale_u8, q.shape[0], MX_GROUP, MX_CODES, True, sms, counters, config
    )


def linear_grouped_mxfp8(x: Tensor, q: Tensor, scale_u8: Tensor, offsets: Tensor, *, sms: int,
                         config: tuple[int, int, int, int, int, int] | None = None) -> Tensor:  # fmt: skip
    """MXFP8 grouped: y [T, N] for bf16 x [T, K] (rows sorted by expert), e4m3 q [E, N, K], uint8
    scales [E, N, K/32], offsets int32 [E + 1] on the device. No host sync."""
    return _grouped(
        x, q.view(torch.int32), scale_u8, offsets, q.shape[1], MX_GROUP, MX_CODES, True, sms, config
    )


def compile_offline(config: tuple[int, int, int, int, int, int], *, group_size: int = 32, even_k: bool = True,
                    grouped: bool = False, capability: int = 90, mx: bool = False):  # fmt: skip
    """Compile `_wo_kernel` (or `_wo_grouped_kernel`) for INT4 (or MXFP8, `mx`) for a CUDA target
    without a GPU: the CompiledKernel (its `asm` holds "ptx" and "cubin"); it fails where an
    operand layout conversion would move data."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    bm, bn, kc, split, warps, kwarps = config
    if grouped:
        names = "x_ptr p_ptr s_ptr y_ptr off_ptr N K k_per_group sxm spe spn sse ssn sym".split()
        types = ["*i32", "*i32", "*u8" if mx else "*bf16", "*bf16", "*i32"] + ["i32"] * 9
        aligned = "x_ptr p_ptr s_ptr y_ptr off_ptr K k_per_group sxm spe spn sym".split()
        kernel, extra = _wo_grouped_kernel, {}
    else:
        names = "x_ptr p_ptr s_ptr y_ptr part_ptr cnt_ptr M N K k_per_group sxm spn ssn sym".split()
        types = ["*i32", "*i32", "*u8" if mx else "*bf16", "*bf16", "*fp32", "*i32"] + ["i32"] * 8
        aligned = "x_ptr p_ptr s_ptr y_ptr part_ptr cnt_ptr K k_per_group sxm spn sym".split()
        kernel, extra = _wo_kernel, {"SPLIT": split}
    cpw = MX_CODES if mx else INT4_CODES
    consts = dict(
        G=MX_GROUP if mx else group_size, BM=bm, BN=bn, KC=kc, W=warps, KW=kwarps,
        LW=word_layout(bn, kc, warps, kwarps, cpw), LX=act_word_layout(bm, kc, warps, kwarps), EVEN_K=even_k,
        CPW=cpw, MX=mx, **extra,
    )  # fmt: skip
    signature = dict(zip(names, types, strict=True)) | {c: "constexpr" for c in consts}
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    src = GluonASTSource(kernel, signature, consts, attrs=attrs)
    return triton.compile(
        src, target=GPUTarget("cuda", capability, 32), options=dict(num_warps=warps * kwarps)
    )


__all__ = [
    "act_layout",
    "compile_offline",
    "grouped_tiling",
    "linear",
    "linear_grouped",
    "linear_grouped_mxfp8",
    "linear_mxfp8",
    "supports",
    "supports_mxfp8",
    "tiling",
    "word_layout",
]
