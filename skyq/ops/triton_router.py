"""The Triton kernel of `router.select_experts` (imported only where it runs: CUDA with Triton)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["R"])
def select_experts_kernel(
    logits_ptr, val_ptr, idx_ptr, R, E, slr, svr, sir,
    K: tl.constexpr, KB: tl.constexpr, BLOCK: tl.constexpr, NORM: tl.constexpr,
):  # fmt: skip
    """Row r: p = softmax(logits[r]) in fp32; the K largest, in descending order (ties: the lower
    expert first), each divided by their sum (added in that order) when NORM; values in the logits'
    dtype. A NaN row picks the lowest experts not yet taken (its values stay NaN), so the indices
    are always experts of the layer."""
    r = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    valid = cols < E
    x = tl.load(logits_ptr + r * slr + cols, mask=valid, other=float("-inf")).to(tl.float32)
    e = tl.where(valid, tl.exp(x - tl.max(x, axis=0)), 0.0)
    p = e / tl.sum(e, axis=0)
    kcols = tl.arange(0, KB)
    vals = tl.zeros([KB], dtype=tl.float32)
    idxs = tl.zeros([KB], dtype=tl.int64)
    free = valid
    total = 0.0
    for j in tl.static_range(K):
        v = tl.max(tl.where(free, p, float("-inf")), axis=0)
        i = tl.min(tl.where(free & (p == v), cols, BLOCK), axis=0)
        i = tl.where(i < E, i, tl.min(tl.where(free, cols, BLOCK), axis=0))  # no match: a NaN row
        free = free & (cols != i)
        vals = tl.where(kcols == j, v, vals)
        idxs = tl.where(kcols == j, i.to(tl.int64), idxs)
        total += v
    if NORM:
        vals = vals / total
    k_ok = kcols < K
    tl.store(val_ptr + r * svr + kcols, vals.to(val_ptr.dtype.element_ty), mask=k_ok)
    tl.store(idx_ptr + r * sir + kcols, idxs, mask=k_ok)


def launch(logits, values, indices, top_k: int, norm: bool) -> None:
    """logits [R, E], values [R, K] (logits' dtype), indices [R, K] int64, unit stride along E / K."""
    r, e = logits.shape
    block = triton.next_power_of_2(e)
    select_experts_kernel[(r,)](
        logits, values, indices, r, e, logits.stride(0), values.stride(0), indices.stride(0),
        K=top_k, KB=triton.next_power_of_2(top_k), BLOCK=block, NORM=norm, num_warps=4 if block >= 1024 else 1,
    )  # fmt: skip
