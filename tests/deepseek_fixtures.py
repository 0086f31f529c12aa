"""Fixtures for the tiny DeepSeek-V3 (`model=tiny_deepseek`, Kimi-K2.6's text architecture) shared by
tests/trainer and tests/rollout: its composed config per precision, one warmed-up checkpoint per
session (cached by config hash in the session's base temp dir, like native_fixtures' tiny_moe one),
trainers and engines on it, and the sender's serialization of a trainer's weights."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from skyq.config.enums import Precision
from skyq.config.schema import TrainConfig
from skyq.config.store import compose, to_object
from skyq.rollout.embedded import EmbeddedEngine
from skyq.trainer.native.tiny_checkpoint import ensure_tiny_checkpoint
from skyq.trainer.native.trainer import NativeTrainer

DEEPSEEK_OVERRIDES = ["model=tiny_deepseek", "model.init_sft_steps=100"]


@pytest.fixture(scope="session")
def deepseek_cfg():
    """`deepseek_cfg(precision)`: the composed default run with model=tiny_deepseek."""
    base = to_object(compose(DEEPSEEK_OVERRIDES))

    def get(precision: str = "bf16") -> TrainConfig:
        return dataclasses.replace(
            base, precision=dataclasses.replace(base.precision, name=Precision(precision))
        )

    return get


@pytest.fixture(scope="session")
def deepseek_checkpoint(deepseek_cfg, tmp_path_factory) -> str:
    cfg = deepseek_cfg()
    cache = tmp_path_factory.getbasetemp() / "skyq_cache"
    return str(ensure_tiny_checkpoint(cfg.model, cfg.task, cache_dir=cache))


@pytest.fixture
def make_deepseek_trainer(deepseek_cfg, deepseek_checkpoint):
    def make(precision: str = "bf16", *, checkpoint: str | None = None, **kwargs: object) -> NativeTrainer:
        cfg = deepseek_cfg(precision)
        return NativeTrainer(
            model_cfg=cfg.model, precision_cfg=cfg.precision, optimizer_cfg=cfg.trainer.optimizer,
            algorithm_cfg=cfg.algorithm, micro_batch_size=64, checkpoint_path=checkpoint or deepseek_checkpoint,
            seed=0, **kwargs,
        )  # fmt: skip

    return make


@pytest.fixture
def make_deepseek_engine(deepseek_cfg):
    def make(precision: str = "bf16") -> EmbeddedEngine:
        cfg = deepseek_cfg(precision)
        return EmbeddedEngine(model_cfg=cfg.model, precision_cfg=cfg.precision, seed=0)

    return make


def serialize_all(trainer: NativeTrainer) -> dict[str, torch.Tensor]:
    """What a sender puts on the wire: the strategy's serialization of every HF tensor."""
    wire: dict[str, torch.Tensor] = {}
    for name, tensor in trainer.hf_weights():
        wire.update(
            trainer.strategy.serialize(name, tensor, role=trainer.layout.role(name, trainer.model_cfg))
        )
    return wire
