"""Each token's routed expert outputs, weighted and added in ascending expert order: one launch on CUDA.

The grouped experts (`WireExperts`) compute every (token, expert) row sorted by expert. The loop they
replace added each token's expert outputs into a bf16 accumulator in ascending expert order
(`index_add_` per expert), so the sum's roundings depend on that order; `combine_reference` keeps it
with torch ops (scatter the weighted rows back, rank each token's experts, then k gathers and k adds:
2k + 6 small kernels a layer). `combine` does the same arithmetic in one Triton launch: each program
takes one token's slice of the hidden size, finds the token's k rows in the sorted order (their
positions ascend with the expert id, since the rows were sorted by expert), and for each, in that
order, rounds `row * weight` to the output dtype and adds it to the accumulator with the same
rounding as a bf16 tensor add (fp32 sum, one rounding). The result equals the reference's bit for
bit (tests/ops/test_moe_combine.py under the Triton interpreter, tests/gpu on the H200).
"""

from __future__ import annotations

import torch
from torch import Tensor

from skyq.ops.moe_route import inverse_permutation
from skyq.quant.kernels import dispatch

HIDDEN_TILE = 256
"""Hidden columns a program adds (one token's rows, k loads of this many values each)."""


def combine_reference(
    down: Tensor, order: Tensor, top_k_index: Tensor, top_k_weights: Tensor, dtype: torch.dtype
) -> Tensor:
    """out [T, H] in `dtype`: for each token, `sum_j bf16(down[row(t, e_j)] * w[t, e_j])` added in
    ascending expert id e_j to zeros, rounding after every add. down [T * k, H]: row i is the
    (token, slot) `order[i]` (flat index t * k + slot), rows sorted by expert."""
    t, k = top_k_index.shape
    routed = torch.empty_like(down)
    routed[order] = down * top_k_weights.reshape(-1)[order, None]
    routed = routed.to(dtype).view(t, k, -1)
    rank = torch.argsort(top_k_index, dim=1)  # each token's experts in ascending order
    out = torch.zeros((t, down.shape[-1]), dtype=dtype, device=down.device)
    for j in range(k):
        out = out + torch.take_along_dim(routed, rank[:, j, None, None], dim=1).squeeze(1)
    return out


def combine(
    down: Tensor,
    order: Tensor,
    top_k_index: Tensor,
    top_k_weights: Tensor,
    dtype: torch.dtype,
    *,
    position: Tensor | None = None,
) -> Tensor:
    """`combine_reference`'s result: one Triton launch on CUDA (plus the inverse permutation of
    `order` unless `position` gives it: `moe_route.Route.position`), the reference elsewhere. No
    host sync."""
    if not dispatch.uses_kernel(down):
        return combine_reference(down, order, top_k_index, top_k_weights, dtype)
    import triton

    from skyq.ops.triton_combine import combine_kernel

    t, k = top_k_index.shape
    h = down.shape[-1]
    if position is None:
        position = inverse_permutation(order)
    weights = top_k_weights.reshape(-1)
    out = torch.empty((t, h), dtype=dtype, device=down.device)
    grid = (t, triton.cdiv(h, HIDDEN_TILE))
    combine_kernel[grid](
        down, order, position, weights, out, h, down.stride(0), down.stride(1), out.stride(0),
        K=k, KP=triton.next_power_of_2(k), BH=HIDDEN_TILE, num_warps=2,
    )  # fmt: skip
    return out
