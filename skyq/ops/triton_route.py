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


@triton.jit(do_not_specialize=["n", "E"])
def block_histogram_kernel(idx_ptr, hist_ptr, n, E, BI: tl.constexpr, EB: tl.constexpr, EC: tl.constexpr):
    """hist[p, e] = #{i in [p * BI, (p + 1) * BI): idx[i] == e} for e < EB (row stride EB), EC
    experts at a time."""
    pid = tl.program_id(0)
    i = pid * BI + tl.arange(0, BI)
    key = tl.load(idx_ptr + i, mask=i < n, other=-1).to(tl.int32)
    for e0 in tl.static_range(0, EB, EC):
        e = e0 + tl.arange(0, EC)
        counts = tl.sum((key[:, None] == e[None, :]).to(tl.int32), axis=0)
        tl.store(hist_ptr + pid * EB + e, counts)


@triton.jit(do_not_specialize=["n", "E", "P"])
def block_rank_kernel(
    idx_ptr, hist_ptr, base_ptr, order_ptr, pos_ptr, off_ptr, tok_ptr, n, E, P,
    K: tl.constexpr, BI: tl.constexpr, EB: tl.constexpr, QC: tl.constexpr,
):  # fmt: skip
    """Entry i of block p = i // BI goes to row start[idx[i]] + #{entries of idx[i] in blocks before p}
    + #{j in block p, j < i: idx[j] == idx[i]}, start[e] = #{j: idx[j] < e} (the offsets, written by
    program 0). Each program sums the histograms (`block_histogram_kernel`) of all P blocks, QC rows
    at a time, and reads its entries' bases back from its row of `base` [P, EB]."""
    pid = tl.program_id(0)
    e = tl.arange(0, EB)
    total = tl.zeros([EB], dtype=tl.int32)
    earlier = tl.zeros([EB], dtype=tl.int32)
    for q0 in range(0, P, QC):
        q = q0 + tl.arange(0, QC)
        h = tl.load(hist_ptr + q[:, None] * EB + e[None, :], mask=q[:, None] < P, other=0)
        total += tl.sum(h, axis=0)
        earlier += tl.sum(tl.where(q[:, None] < pid, h, 0), axis=0)
    start = tl.cumsum(total, axis=0) - total
    if pid == 0:
        tl.store(off_ptr + e, start, mask=e <= E)
    tl.store(base_ptr + pid * EB + e, start + earlier)
    tl.debug_barrier()  # the row is stored before its entries read it back
    i = pid * BI + tl.arange(0, BI)
    ok = i < n
    key = tl.load(idx_ptr + i, mask=ok, other=-1).to(tl.int32)
    j = pid * BI + tl.arange(0, BI)
    same_before = (key[None, :] == key[:, None]) & (j[None, :] < i[:, None])
    local = tl.sum(same_before.to(tl.int32), axis=1)
    base = tl.load(base_ptr + pid * EB + key, mask=ok, other=0)
    rank = (base + local).to(tl.int64)
    tl.store(pos_ptr + i, rank, mask=ok)
    tl.store(order_ptr + rank, i.to(tl.int64), mask=ok)
    tl.store(tok_ptr + rank, (i // K).to(tl.int64), mask=ok)
