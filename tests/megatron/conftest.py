"""tests/megatron: megatron-core's own User- and DeprecationWarnings (no Apex / Transformer Engine on
the CPU, its deprecations) are noise here; the spawned ranks filter theirs in dist_helpers."""

from pathlib import Path

import pytest

HERE = Path(__file__).parent


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.parent == HERE:
            item.add_marker(pytest.mark.filterwarnings("ignore::UserWarning:megatron"))
            item.add_marker(pytest.mark.filterwarnings("ignore::DeprecationWarning:megatron"))
