"""The Triton kernel of `rotary.apply_rotary_pos_emb` (imported only where it runs: CUDA with Triton)."""

from __future__ import annotations

import triton
import triton.language as tl

from skyq.ops.triton_math import round_to


@triton.jit
def _rotate_row(x_ptr, o_ptr, c_ptr, s_ptr, HALF: tl.constexpr, DTYPE: tl.constexpr):
    """One head row: o = x * cos + rotate_half(x) * sin, each product and the sum rounded to DTYPE
    as the three tensor ops of the transformers formula round them (the negation is exact)."""
    i = tl.arange(0, HALF)
    x1 = tl.load(x_ptr + i).to(tl.float32)
    x2 = tl.load(x_ptr + HALF + i).to(tl.float32)
    c1 = tl.load(c_ptr + i).to(tl.float32)
    c2 = tl.load(c_ptr + HALF + i).to(tl.float32)
    s1 = tl.load(s_ptr + i).to(tl.float32)
    s2 = tl.load(s_ptr + HALF + i).to(tl.float32)
    o1 = round_to(round_to(x1 * c1, DTYPE) + round_to(-x2 * s1, DTYPE), DTYPE)
    o2 = round_to(round_to(x2 * c2, DTYPE) + round_to(x1 * s2, DTYPE), DTYPE)
    tl.store(o_ptr + i, o1.to(DTYPE))
    tl.store(o_ptr + HALF + i, o2.to(DTYPE))


@triton.jit(do_not_specialize=["T", "HQ", "HK"])
def rotary_kernel(
    q_ptr, k_ptr, qo_ptr, ko_ptr, cos_ptr, sin_ptr, T, HQ, HK,
    sqb, sqh, sqt, skb, skh, skt, sqob, sqoh, sqot, skob, skoh, skot, scb, sct,
    HALF: tl.constexpr,
):  # fmt: skip
    """Program (b * T + t, head): that head row of q (head < HQ) and of k (head < HK), with the
    cos/sin row of (b, t). q/k [B, H, T, D] of any strides with unit stride along D."""
    bt = tl.program_id(0)
    h = tl.program_id(1)
    b = bt // T
    t = bt % T
    c_ptr = cos_ptr + b.to(tl.int64) * scb + t * sct
    s_ptr = sin_ptr + b.to(tl.int64) * scb + t * sct
    dtype: tl.constexpr = qo_ptr.dtype.element_ty
    if h < HQ:
        q_row = q_ptr + b.to(tl.int64) * sqb + h * sqh + t * sqt
        _rotate_row(q_row, qo_ptr + b.to(tl.int64) * sqob + h * sqoh + t * sqot, c_ptr, s_ptr, HALF, dtype)
    if h < HK:
        k_row = k_ptr + b.to(tl.int64) * skb + h * skh + t * skt
        _rotate_row(k_row, ko_ptr + b.to(tl.int64) * skob + h * skoh + t * skot, c_ptr, s_ptr, HALF, dtype)


def launch(q, k, q_out, k_out, cos, sin) -> None:
    """q, k, q_out, k_out [B, H, T, D]; cos, sin [B or 1, T, D] (same strides; one batch row is
    shared by all, as decoding rows at the same positions gives it), D / 2 a power of two."""
    b, hq, t, d = q.shape
    hk = k.shape[1]
    rotary_kernel[(b * t, max(hq, hk))](
        q, k, q_out, k_out, cos, sin, t, hq, hk,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        q_out.stride(0), q_out.stride(1), q_out.stride(2), k_out.stride(0), k_out.stride(1), k_out.stride(2),
        cos.stride(0) if cos.shape[0] == b else 0, cos.stride(1), HALF=d // 2, num_warps=1,
    )  # fmt: skip
