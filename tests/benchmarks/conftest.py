"""Fixtures: the shared native-trainer fixtures (tests/native_fixtures.py)."""

from native_fixtures import _one_thread, make_trainer, run_cfg, tiny_checkpoint  # noqa: F401
