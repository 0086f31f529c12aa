"""Fixtures: the shared native-trainer fixtures (tests/native_fixtures.py) and the tiny DeepSeek-V3's
(tests/deepseek_fixtures.py) and the tiny Kimi-K2.6 with its vision tower's
(tests/multimodal_fixtures.py)."""

from deepseek_fixtures import deepseek_cfg, deepseek_checkpoint, make_deepseek_trainer  # noqa: F401
from multimodal_fixtures import dots_dir, make_vl_trainer, vl_cfg, vl_prompts  # noqa: F401
from native_fixtures import _one_thread, make_trainer, run_cfg, tiny_checkpoint  # noqa: F401
