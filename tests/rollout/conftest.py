"""Fixtures: the shared native-trainer fixtures (tests/native_fixtures.py) and the tiny DeepSeek-V3's
(tests/deepseek_fixtures.py) and the tiny Kimi-K2.6 with its vision tower's
(tests/multimodal_fixtures.py), plus an embedded engine and the sender's serialization of a trainer's weights."""

from __future__ import annotations

import pytest
import torch
from deepseek_fixtures import (  # noqa: F401
    deepseek_cfg,
    deepseek_checkpoint,
    make_deepseek_engine,
    make_deepseek_trainer,
)
from multimodal_fixtures import dots_dir, make_vl_engine, make_vl_trainer, vl_cfg, vl_prompts  # noqa: F401
from native_fixtures import _one_thread, make_trainer, run_cfg, tiny_checkpoint  # noqa: F401

from skyq.rollout.embedded import EmbeddedEngine
from skyq.trainer.native.trainer import NativeTrainer


@pytest.fixture
def make_engine(run_cfg):  # noqa: F811
    def make(precision: str = "fp8_blockwise") -> EmbeddedEngine:
        cfg = run_cfg(precision)
        return EmbeddedEngine(model_cfg=cfg.model, precision_cfg=cfg.precision, seed=0)

    return make


def serialize_all(trainer: NativeTrainer) -> dict[str, torch.Tensor]:
    """What a sender puts on the wire: the strategy's serialization of every HF tensor."""
    wire: dict[str, torch.Tensor] = {}
    for name, tensor in trainer.hf_weights():
        role = trainer.layout.role(name, trainer.model_cfg)
        wire.update(trainer.strategy.serialize(name, tensor, role=role))
    return wire


@pytest.fixture
def serialize():
    return serialize_all
