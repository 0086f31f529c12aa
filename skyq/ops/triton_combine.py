"""The Triton kernel of `moe_combine.combine` (imported only where it runs: CUDA with Triton)."""

from __future__ import annotations

import triton
import triton.language as tl

from skyq.ops.triton_math import round_to


@triton.jit
def combine_kernel(
    down_ptr, order_ptr, pos_ptr, w_ptr, out_ptr, H, sdr, sdh, sor,
    K: tl.constexpr, KP: tl.constexpr, BH: tl.constexpr,
):  # fmt: skip
    """out[tok, h-tile] = the token's K rows of `down`, each times its weight rounded to the output
    dtype, added from zero in ascending expert order with a rounding after every add."""
    tok = tl.program_id(0)
    rh = tl.program_id(1) * BH + tl.arange(0, BH)
    h_ok = rh < H
    slot = tl.arange(0, KP)
    # the token's rows in the sorted order; ascending positions = ascending expert ids, so a row's
    # rank among them (how many of the positions are smaller) is its place in the sum
    pos = tl.load(pos_ptr + tok * K + slot, mask=slot < K, other=2**62)
    rank = tl.sum((pos[None, :] < pos[:, None]).to(tl.int32), axis=1)
    dtype: tl.constexpr = out_ptr.dtype.element_ty
    acc = tl.zeros([BH], dtype=tl.float32)
    for j in tl.static_range(K):
        p = tl.sum(tl.where(rank == j, pos, 0))
        w = tl.load(w_ptr + tl.load(order_ptr + p)).to(tl.float32)
        row = tl.load(down_ptr + p * sdr + rh * sdh, mask=h_ok, other=0.0).to(tl.float32)
        acc = round_to(acc + round_to(row * w, dtype), dtype)
    tl.store(out_ptr + tok.to(tl.int64) * sor + rh, acc.to(dtype), mask=h_ok)
