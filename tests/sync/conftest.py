"""A fresh seed per test, printed so a failure can be replayed with SKYQ_TEST_SEED=<seed>."""

from __future__ import annotations

import os
import secrets

import pytest
import torch


@pytest.fixture
def gen() -> torch.Generator:
    seed = int(os.environ.get("SKYQ_TEST_SEED", secrets.randbits(32)))
    print(f"SKYQ_TEST_SEED={seed}")
    return torch.Generator().manual_seed(seed)
