"""Fixtures: the shared native-trainer fixtures (tests/native_fixtures.py) and the tiny DeepSeek-V3's
(tests/deepseek_fixtures.py)."""

from deepseek_fixtures import deepseek_cfg, deepseek_checkpoint, make_deepseek_trainer  # noqa: F401
from native_fixtures import _one_thread, make_trainer, run_cfg, tiny_checkpoint  # noqa: F401
