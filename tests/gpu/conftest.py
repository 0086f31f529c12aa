"""GPU tests: marked `gpu` and skipped where CUDA (or Triton, for the kernels) is absent, so CI,
which has neither, skips them. Each test draws fresh random data; the seed is printed so a
failure can be replayed with SKYQ_TEST_SEED=<seed>."""

from __future__ import annotations

import os
import secrets

import pytest
import torch
from native_fixtures import make_trainer, run_cfg, tiny_checkpoint  # noqa: F401 (trainer fixtures)


def replayed(fn):
    """`fn()` captured in a CUDA graph (its launches only, not run) and then replayed once: the
    output, for a test that the capture has no host sync and replays the eager bits."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    graph.replay()
    torch.cuda.synchronize()
    return out


@pytest.fixture
def gen() -> torch.Generator:
    seed = int(os.environ.get("SKYQ_TEST_SEED", secrets.randbits(32)))
    print(f"SKYQ_TEST_SEED={seed}")
    return torch.Generator().manual_seed(seed)


@pytest.fixture
def make_weight(gen: torch.Generator):
    """`make_weight(shape, dtype, layout="contiguous")`, see `_spread_weight`."""
    return lambda shape, dtype, layout="contiguous": _spread_weight(gen, tuple(shape), dtype, layout)


def _spread_weight(
    gen: torch.Generator, shape: tuple[int, ...], dtype: torch.dtype, layout: str
) -> torch.Tensor:
    """Normal values with per-row magnitudes spread over 6 decades, made on the CPU (so the draw
    is reproducible from the seed) and moved to the GPU in the requested memory layout."""
    *lead, n, k = shape
    if layout == "transposed":
        base = torch.randn((*lead, k, n), generator=gen) * 10.0 ** (
            torch.rand((*lead, 1, n), generator=gen) * 6 - 3
        )
        return base.to(dtype).cuda().transpose(-1, -2)
    if layout == "strided":
        base = torch.randn((*lead, n, 2 * k), generator=gen) * 10.0 ** (
            torch.rand((*lead, n, 1), generator=gen) * 6 - 3
        )
        return base.to(dtype).cuda()[..., ::2]
    base = torch.randn(shape, generator=gen) * 10.0 ** (torch.rand((*lead, n, 1), generator=gen) * 6 - 3)
    return base.to(dtype).cuda()
