"""Launch helper shared by the decode GEMV kernels (torch only; no Triton import here)."""

from __future__ import annotations

import torch
from torch import Tensor


def gemv_outputs(
    x: Tensor, m: int, n: int, grid: tuple[int, int, int], counters
) -> tuple[Tensor, Tensor, Tensor]:
    """(y, partials, arrival counters) of a decode launch over `grid` (N tiles, M tiles, splits):
    y [m, n] in x's dtype; with more than one split, fp32 partials [split, m, n] and
    `counters(device, tiles)`, a zeroed int32 buffer the launch leaves zeroed; else y for both."""
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if grid[2] == 1:
        return y, y, y
    part = torch.empty((grid[2], m, n), dtype=torch.float32, device=x.device)
    return y, part, counters(x.device, grid[0] * grid[1])
