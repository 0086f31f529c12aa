"""Fixtures for the quantizer tests: a fresh seed per test (printed, so a failure can be replayed
with SKYQ_TEST_SEED=<seed>) and a weight factory covering dtypes and memory layouts."""

from __future__ import annotations

import os
import secrets

import pytest
import torch
from hypothesis import HealthCheck, settings

settings.register_profile(
    "skyq", max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile("skyq")

LAYOUTS = ("contiguous", "transposed", "strided")


@pytest.fixture
def gen() -> torch.Generator:
    seed = int(os.environ.get("SKYQ_TEST_SEED", secrets.randbits(32)))
    print(f"SKYQ_TEST_SEED={seed}")
    return torch.Generator().manual_seed(seed)


def random_weight(
    gen: torch.Generator,
    shape: tuple[int, ...],
    dtype: torch.dtype = torch.float32,
    layout: str = "contiguous",
) -> torch.Tensor:
    """Normal values with a per-row magnitude spread over 6 decades, in the requested layout:
    `transposed` is a transpose of the last two dims, `strided` takes every other column."""
    *lead, n, k = shape
    if layout == "transposed":
        out = _spread(gen, (*lead, k, n), -1).to(dtype).transpose(-1, -2)
    elif layout == "strided":
        out = _spread(gen, (*lead, n, 2 * k), -2).to(dtype)[..., ::2]
    else:
        out = _spread(gen, shape, -1).to(dtype)
    assert tuple(out.shape) == tuple(shape)
    assert layout == "contiguous" or min(n, k) == 1 or not out.is_contiguous()
    return out


def _spread(gen: torch.Generator, shape: tuple[int, ...], row_dim: int) -> torch.Tensor:
    x = torch.randn(shape, generator=gen)
    mag_shape = list(shape)
    mag_shape[row_dim] = 1
    return x * 10.0 ** (torch.rand(mag_shape, generator=gen) * 6 - 3)


@pytest.fixture(scope="session")
def weight_from_seed():
    """For hypothesis tests: `weight_from_seed(seed, shape, dtype, layout)`, a pure function."""

    def make(seed, shape, dtype=torch.float32, layout="contiguous"):
        return random_weight(torch.Generator().manual_seed(seed), tuple(shape), dtype, layout)

    return make


@pytest.fixture
def make_weight(gen: torch.Generator):
    def make(shape, dtype=torch.float32, layout="contiguous"):
        return random_weight(gen, tuple(shape), dtype, layout)

    return make
