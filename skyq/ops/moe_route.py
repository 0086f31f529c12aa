"""Where each routed (token, expert) row goes in the grouped experts: one launch on CUDA.

`WireExperts` sorts the k rows of each token by expert (stable: by expert, then token) so each
expert's rows are contiguous for the grouped GEMMs. In torch that is a stable argsort, an arange, a
searchsorted, a gather, a cast and a division, then an inverse-permutation scatter in the combine:
a radix sort and ~8 small kernels a layer, more than the experts' GEMMs take at decode sizes
(benchmarks/engine_decode.py --profile). `route` computes the same integers by counting: an entry's
place is the number of entries with a smaller expert, or the same expert and a smaller index; expert
e's first row is the number of entries below e. Up to `ONE_LAUNCH_MAX_ENTRIES` in one Triton launch
(each program ranks 64 entries against all of them), above in two linear ones (each block of 64
entries' expert histogram, then each entry's place from the histograms of the blocks before it and
the entries before it in its block). Integers, so the result is the reference's exactly
(tests/ops/test_moe_route.py under the Triton interpreter, tests/gpu).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from skyq.quant.kernels import dispatch

KERNEL_MAX_ENTRIES = 8192
"""Routed rows (tokens x k) the kernel takes (a decode step of 1024 tokens x top-8); more take the
reference (prefill). The reference is a radix sort and ~8 small kernels a layer, a launch-bound cost
in every decode step (`benchmarks/engine_decode.py --profile`; docs/benchmarks.md)."""


ONE_LAUNCH_MAX_ENTRIES = 512
"""Routed rows the one-launch kernel (`triton_route.route_kernel`: every entry ranked against all of
them, quadratic) takes; more go to the two block-counting launches (`block_histogram_kernel`, then
`block_rank_kernel`: linear), whose cost grows with the rows while the one launch's grows with
their square (`benchmarks/moe_decode.py --routing`; docs/benchmarks.md)."""

ROWS_PER_PROGRAM = 64
"""Entries one program of the kernel ranks (each also bounds its share of the experts): the counting
is quadratic in the entries a program holds, so more programs of fewer entries each keep it short
(`benchmarks/engine_decode.py --profile`; docs/benchmarks.md)."""


class Route(NamedTuple):
    order: Tensor
    """[T * k] int64: the flat (token * k + slot) index of each sorted row."""
    position: Tensor
    """[T * k] int64: the sorted row of each flat index (order's inverse)."""
    offsets: Tensor
    """[E + 1] int32: expert e's rows are offsets[e]:offsets[e + 1]."""
    token: Tensor
    """[T * k] int64: the token of each sorted row (order // k)."""


def inverse_permutation(order: Tensor) -> Tensor:
    """position with position[order[i]] = i."""
    return torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))


def route_reference(top_k_index: Tensor, num_experts: int) -> Route:
    """The rows sorted by expert, then by flat index, with torch ops."""
    k = top_k_index.shape[-1]
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    bounds = torch.arange(num_experts + 1, device=flat.device, dtype=flat.dtype)
    offsets = torch.searchsorted(flat[order], bounds).to(torch.int32)
    return Route(order, inverse_permutation(order), offsets, order // k)


def route(top_k_index: Tensor, num_experts: int) -> Route:
    """`route_reference`'s integers: on CUDA one Triton launch for at most `ONE_LAUNCH_MAX_ENTRIES`
    rows, two up to `KERNEL_MAX_ENTRIES`; the reference elsewhere. No host sync."""
    n = top_k_index.numel()
    if not (
        dispatch.uses_kernel(top_k_index) and 0 < n <= KERNEL_MAX_ENTRIES and top_k_index.is_contiguous()
    ):
        return route_reference(top_k_index, num_experts)
    import triton

    from skyq.ops import triton_route

    device = top_k_index.device
    order, position, token = (torch.empty(n, dtype=torch.int64, device=device) for _ in range(3))
    offsets = torch.empty(num_experts + 1, dtype=torch.int32, device=device)
    eb = max(16, triton.next_power_of_2(num_experts + 1))
    k = top_k_index.shape[-1]
    if n > ONE_LAUNCH_MAX_ENTRIES:  # counting in blocks: linear in n, two launches
        blocks = triton.cdiv(n, ROWS_PER_PROGRAM)
        hist, base = (torch.empty(blocks * eb, dtype=torch.int32, device=device) for _ in range(2))
        triton_route.block_histogram_kernel[(blocks,)](
            top_k_index, hist, n, num_experts, BI=ROWS_PER_PROGRAM, EB=eb, EC=min(eb, 128), num_warps=4
        )
        triton_route.block_rank_kernel[(blocks,)](
            top_k_index, hist, base, order, position, offsets, token, n, num_experts, blocks,
            K=k, BI=ROWS_PER_PROGRAM, EB=eb, QC=max(1, min(16, 4096 // eb)), num_warps=4,
        )  # fmt: skip
        return Route(order, position, offsets, token)
    nb = max(16, triton.next_power_of_2(n))
    programs = max(1, nb // ROWS_PER_PROGRAM)  # a power of two
    triton_route.route_kernel[(programs,)](
        top_k_index, order, position, offsets, token, n, num_experts,
        K=k, NB=nb, CHUNK=min(nb, 32), BI=nb // programs, BE=max(16, eb // programs),
        num_warps=4,
    )  # fmt: skip
    return Route(order, position, offsets, token)
