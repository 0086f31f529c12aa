"""The Triton kernel of `moe_route.route` (imported only where it runs: CUDA with Triton)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["n", "E"])
def route_kernel(
    idx_ptr, order_ptr, pos_ptr, off_ptr, tok_ptr, n, E,
    K: tl.constexpr, NB: tl.constexpr, CHUNK: tl.constexpr, BI: tl.constexpr, BE: tl.constexpr,
):  # fmt: skip
    """Program p takes entries [p * BI, (p + 1) * BI) and experts [p * BE, (p + 1) * BE). Entry i
    (expert idx[i]) goes to row rank(i) = #{j: idx[j] < idx[i] or (idx[j] == idx[i] and j < i)};
    offsets[e] = #{j: idx[j] < e}, e in [0, E]. Each program reads all NB entries, CHUNK at a time."""
    pid = tl.program_id(0)
    i = pid * BI + tl.arange(0, BI)
    big = 2**62
    key_i = tl.load(idx_ptr + i, mask=i < n, other=big).to(tl.int64)
    e = (pid * BE + tl.arange(0, BE)).to(tl.int64)
    rank = tl.zeros([BI], dtype=tl.int32)
    below = tl.zeros([BE], dtype=tl.int32)
    for j0 in tl.range(0, NB, CHUNK):
        j = j0 + tl.arange(0, CHUNK)
        key_j = tl.load(idx_ptr + j, mask=j < n, other=big).to(tl.int64)
        before = (key_j[None, :] < key_i[:, None]) | (
            (key_j[None, :] == key_i[:, None]) & (j[None, :] < i[:, None])
        )
        rank += tl.sum(before.to(tl.int32), axis=1)
        below += tl.sum((key_j[None, :] < e[:, None]).to(tl.int32), axis=1)
    ok = i < n
    rank64 = rank.to(tl.int64)
    tl.store(pos_ptr + i, rank64, mask=ok)
    tl.store(order_ptr + rank64, i.to(tl.int64), mask=ok)
    tl.store(tok_ptr + rank64, (i // K).to(tl.int64), mask=ok)
    tl.store(off_ptr + e, below, mask=e <= E)
