"""Shared set-up for the launch tests: composed configs, one tiny-checkpoint cache per session."""

from __future__ import annotations

import pytest

from .run_helpers import TEST_OVERRIDES


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> str:
    """Where the tiny checkpoint is built once for the whole session."""
    return str(tmp_path_factory.mktemp("skyq_cache"))


@pytest.fixture(scope="session")
def base_overrides(cache_dir) -> list[str]:
    return [*TEST_OVERRIDES, f"checkpoint.cache_dir={cache_dir}"]
