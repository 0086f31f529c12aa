"""Apply a row-wise quantizer to a large weight a slab of rows at a time.

Every skyq weight format is independent across row slabs whose height is a multiple of the block
(fp8 blockwise: bn rows; per-channel and int4 groups: one row), so quantizing slab by slab gives the
same bits as one call on the whole tensor while its fp32 temporaries stay in cache and no
gigabyte-sized intermediate is allocated (page faults on such temporaries dominated the eager
quantizers' time on the CPU; docs/benchmarks.md, M6 converters, "The converter code's CPU choices").
"""

from __future__ import annotations

from collections.abc import Callable

import torch

SLAB_ELEMENTS = 1 << 20  # ~4 MB of fp32 temporaries per op


def slab_rows(shape: tuple[int, ...], multiple: int) -> int:
    """Rows per slab: about SLAB_ELEMENTS elements, rounded down to a multiple of `multiple`."""
    rows = max(1, SLAB_ELEMENTS // max(1, shape[-1]))
    return max(multiple, rows // multiple * multiple)


def quantize_by_rows(
    w: torch.Tensor, quantize: Callable[[torch.Tensor], tuple[torch.Tensor, ...]], *, multiple: int
) -> tuple[torch.Tensor, ...]:
    """`quantize(w)` computed over row slabs of `w` (2-D) and concatenated along rows.

    Each output of `quantize` must have one row per `rows / multiple` input rows (codes: per row;
    blockwise scales: per block row), which is what makes the slabs independent.
    """
    rows = slab_rows(tuple(w.shape), multiple)
    if w.ndim != 2 or w.shape[0] <= rows or w.is_cuda:  # a GPU has no cache to fit: one call
        return quantize(w)
    parts = [quantize(w[i : i + rows]) for i in range(0, w.shape[0], rows)]
    return tuple(_cat(list(outputs)) for outputs in zip(*parts))


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    if parts[0].dtype.itemsize == 1 and parts[0].dtype.is_floating_point:
        # torch.cat has no memcpy path for float8 (much slower than for bytes; docs/benchmarks.md, M6
        # converters): concatenate the bytes
        return torch.cat([p.view(torch.uint8) for p in parts]).view(parts[0].dtype)
    return torch.cat(parts)
