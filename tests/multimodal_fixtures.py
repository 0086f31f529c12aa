"""Fixtures for the tiny Kimi-K2.6 with its vision tower (`model=tiny_kimi_vl`) shared by tests/trainer,
tests/rollout and tests/e2e: the dot-count data and random-init checkpoint `skyq.tools.make_dot_count`
writes (once per session), the composed config per precision, trainers and engines on it, and
multimodal prompts built the way the run loop builds them."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from skyq.config.enums import Precision
from skyq.config.schema import TrainConfig
from skyq.config.store import compose, to_object
from skyq.rl.batch import ImagePrompt
from skyq.rl.image_tokens import expand, image_token_id
from skyq.rl.tasks import build_task
from skyq.rl.tokenizer import load_tokenizer
from skyq.rollout.embedded import EmbeddedEngine
from skyq.tools.make_dot_count import write_checkpoint, write_dataset
from skyq.trainer.native.trainer import NativeTrainer

MAX_IMAGE_TOKENS = 4


@pytest.fixture(scope="session")
def dots_dir(tmp_path_factory) -> Path:
    """<dir>/dots.jsonl (24 rows, 1-3 dots) and <dir>/checkpoint (tiny_kimi_vl at seed 0 + tokenizer)."""
    root = tmp_path_factory.mktemp("dots")
    write_dataset(root, rows=24, max_dots=3, seed=0)
    write_checkpoint(root / "checkpoint", seed=0)
    return root


@pytest.fixture(scope="session")
def vl_cfg(dots_dir):
    """`vl_cfg(precision)`: the composed CPU recipe on the session's data and checkpoint."""
    base = to_object(
        compose(
            [
                "recipe=tiny_kimi_vl_int4_qat_cpu_dots",
                f"checkpoint.hf_checkpoint={dots_dir / 'checkpoint'}",
                f"task.dataset={dots_dir / 'dots.jsonl'}",
            ]
        )
    )

    def get(precision: str = "bf16") -> TrainConfig:
        return dataclasses.replace(
            base, precision=dataclasses.replace(base.precision, name=Precision(precision))
        )

    return get


@pytest.fixture
def make_vl_trainer(vl_cfg, dots_dir):
    def make(precision: str = "bf16", **kwargs: object) -> NativeTrainer:
        cfg = vl_cfg(precision)
        return NativeTrainer(
            model_cfg=cfg.model, precision_cfg=cfg.precision, optimizer_cfg=cfg.trainer.optimizer,
            algorithm_cfg=cfg.algorithm, micro_batch_size=64, checkpoint_path=str(dots_dir / "checkpoint"),
            seed=0, **kwargs,
        )  # fmt: skip

    return make


@pytest.fixture
def make_vl_engine(vl_cfg):
    def make(precision: str = "bf16") -> EmbeddedEngine:
        cfg = vl_cfg(precision)
        return EmbeddedEngine(model_cfg=cfg.model, precision_cfg=cfg.precision, seed=0, eos_token_id=2)

    return make


@pytest.fixture(scope="session")
def vl_prompts(vl_cfg, dots_dir):
    """`vl_prompts(n)`: the first step's n prompts as the loop gives them to the engine (`ImagePrompt`s),
    with their answers."""
    cfg = vl_cfg()
    tokenizer = load_tokenizer(dots_dir / "checkpoint")
    task = build_task(cfg.task, seed=0, tokenizer=tokenizer)
    token_id = image_token_id(tokenizer)

    def get(n: int) -> tuple[list[ImagePrompt], list[str]]:
        prompts = task.prompts(0, n)
        inputs = [
            expand(p.token_ids, p.images, token_id=token_id, max_tokens=MAX_IMAGE_TOKENS) for p in prompts
        ]
        return inputs, [p.answer for p in prompts]

    return get
