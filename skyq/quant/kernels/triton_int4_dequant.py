"""INT4 `pack-quantized` dequantization in registers: eight 4-bit codes of an int32 word turned into
bf16(code * scale) without an int-to-float conversion, bit for bit `int4.dequantize_packed`'s weight.

Two users share it: `triton_int4.dequantize_packed` (converters, weight sync: a dense bf16 weight
from packed words) and the engine's INT4 decode kernel (`skyq.rollout.kernels.triton_int4_gemv`),
which dequantizes each weight tile this way right before its MMA.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

from skyq.quant.kernels._common import cdiv


@triton.jit
def _code(words, j: tl.constexpr, s):
    """bf16(code j of each word * s): the nibble ORed into the mantissa of 2^23 is 2^23 + nibble
    exactly, minus 2^23 + 8 the signed code (no int-to-float conversion), times the scale in fp32,
    rounded once to bf16."""
    nib = (words >> (4 * j)) & 0xF
    code = (nib | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0
    return (code * s).to(tl.bfloat16)


@triton.jit
def _code_pair(words, j: tl.constexpr, s2, ASM: tl.constexpr, s):
    """(bf16(code j * s), bf16(code j + 4 * s)) of each word. ASM (sm_90 PTX): on packed bf16 pairs,
    nibbles j and j + 4 ORed into 0x4300 (bf16 128: 128 + nibble exactly), minus 136 (exact), times
    the scale pair s2 (one rounding of an exact product: the same bits as `_code`), 4 instructions a
    pair; else `_code` twice (the Triton interpreter runs no PTX)."""
    if ASM:
        lo, hi = tl.inline_asm_elementwise(
            f"""{{
            .reg .b32 t, c;
            shr.u32 t, $2, {4 * j};
            and.b32 t, t, 0x000F000F;
            or.b32 t, t, 0x43004300;
            mov.b32 c, 0x43084308;
            sub.rn.bf16x2 t, t, c;
            mul.rn.bf16x2 t, t, $3;
            mov.b32 {{$0, $1}}, t;
            }}""",
            "=h,=h,r,r",
            [words, s2],
            dtype=(tl.bfloat16, tl.bfloat16),
            is_pure=True,
            pack=1,
        )
        return tl.join(lo, hi)
    return tl.join(_code(words, j, s), _code(words, j + 4, s))


@triton.jit
def dequantized_words(words, s, BN: tl.constexpr, TK: tl.constexpr, ASM: tl.constexpr):
    """[BN, TK] bf16 weights from [BN, TK / 8] words and their fp32 scales, code j of word w at column
    8 w + j: the eight codes joined along three new trailing dims (a, b, c), j = 4 a + 2 b + c, each
    join held in one thread's registers, so the reshape moves no data."""
    if ASM:  # the bf16 scale twice in one register
        bits = s.to(tl.bfloat16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        s2 = bits | (bits << 16)
    else:
        s2 = words  # unused by the Triton formulation (`_code` takes the fp32 scales)
    r00 = _code_pair(words, 0, s2, ASM, s)
    r01 = _code_pair(words, 1, s2, ASM, s)
    r10 = _code_pair(words, 2, s2, ASM, s)
    r11 = _code_pair(words, 3, s2, ASM, s)
    abc = tl.join(tl.join(r00, r10), tl.join(r01, r11))
    return tl.reshape(abc, (BN, TK))


DEQUANT_TILE = (32, 256)
"""(BN, TK) of `dequantize`: 8192 weights a program at 4 warps."""


ASM = True
"""Dequantize with `_code_pair`'s PTX on devices of compute capability >= 9 (False: the Triton
formulation everywhere, the same bits; tests and benchmarks A/B them). The decode GEMV takes the PTX
only in row tiles of at most `skyq.rollout.kernels.triton_int4_gemv.ASM_MAX_ROWS`."""


@functools.cache
def _capability(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


def asm(x: Tensor) -> bool:
    """`_code_pair`'s PTX applies to x's device: a CUDA device of compute capability >= 9 (its
    bf16x2 sub and mul), so never under the Triton interpreter (CPU tensors)."""
    return ASM and x.is_cuda and _capability(x.device.index or 0) >= 9


@triton.jit
def _dequant_kernel(p_ptr, s_ptr, out_ptr, N, K, BN: tl.constexpr, TK: tl.constexpr, G: tl.constexpr,
                    ASM: tl.constexpr):  # fmt: skip
    """out[b, n, k] = bf16(q[b, n, k] * s[b, n, k // G]) for tile (N tile, K tile, b) of contiguous
    packed [B, N, K/8] words and bf16 scales [B, N, K/G] (K % 8 == 0, G % 8 == 0): the GEMV kernels'
    register dequantization (`dequantized_words`), then one 2-D store."""
    b = tl.program_id(2).to(tl.int64)
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    rw = tl.program_id(1) * (TK // 8) + tl.arange(0, TK // 8)
    ok = (rn < N)[:, None] & (rw < K // 8)[None, :]
    rows = rn[:, None].to(tl.int64)
    words = tl.load(p_ptr + b * N * (K // 8) + rows * (K // 8) + rw[None, :], mask=ok, other=0)
    s = tl.load(s_ptr + b * N * (K // G) + rows * (K // G) + ((rw * 8) // G)[None, :], mask=ok, other=0.0)
    w = dequantized_words(words, s.to(tl.float32), BN, TK, ASM)
    rk = tl.program_id(1) * TK + tl.arange(0, TK)
    ok_k = (rn < N)[:, None] & (rk < K)[None, :]
    tl.store(out_ptr + b * N * K + rows * K + rk[None, :], w, mask=ok_k)


def dequantize(packed: Tensor, scale: Tensor, n: int, k: int, group_size: int) -> Tensor:
    """bf16 [B, N, K] from contiguous packed int32 [B, N, K/8] and bf16 scales [B, N, K/G] (shapes
    checked by the caller): `int4.dequantize_packed`'s bits (each weight bf16(code * scale))."""
    nb = packed.shape[0]
    out = torch.empty((nb, n, k), dtype=torch.bfloat16, device=packed.device)
    if out.numel() == 0:
        return out
    bn, tk = DEQUANT_TILE
    _dequant_kernel[(cdiv(n, bn), cdiv(k, tk), nb)](
        packed, scale, out, n, k, BN=bn, TK=tk, G=group_size, ASM=asm(packed), num_warps=4
    )  # fmt: skip
    return out
