"""The GRPO run loop with trainer=megatron rollout=embedded on the CPU (tiny Qwen3-MoE, gloo): the
real driver (`skyq.launch.loop.run_rl`, what `python -m skyq.train` calls after validating), its
Ray actors, syncs verified every step, a checkpoint, then a resume from it.

`python -m skyq.train trainer=megatron` itself still stops at validation on topology=cpu
(skyq/config/validate.py refuses a Megatron trainer without GPUs): the driver is called as the
launch tests call it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf

pytest.importorskip("megatron.core")
pytest.importorskip("ray")

from skyq.config.store import compose, to_object  # noqa: E402
from skyq.launch.loop import run_rl  # noqa: E402

OVERRIDES = [
    "trainer=megatron",
    "precision=bf16",
    "task.arith_op=copy",
    "model.init_sft_steps=10",
    "algorithm.global_batch_size=32",
    "trainer.micro_batch_size=16",
    "checkpoint.save_interval=2",
    "logger.progress_bar=false",
    "logger.plot=false",
]


def _run(overrides: list[str], run_dir: Path, *, resume: bool = False):
    cfg = compose(overrides)
    c = to_object(cfg)
    return run_rl(
        model=c.model, precision=c.precision, algorithm=c.algorithm, task=c.task, rollout=c.rollout,
        trainer=c.trainer, topology=c.topology, logger=c.logger, checkpoint=c.checkpoint, seed=c.seed,
        config_container=OmegaConf.to_container(cfg, resolve=True, enum_to_str=True), run_dir=run_dir,
        resume=resume,
    )  # fmt: skip


@pytest.mark.slow
def test_megatron_grpo_run_logs_reward_and_syncs_then_resumes(tmp_path):
    common = [*OVERRIDES, f"checkpoint.cache_dir={tmp_path / 'cache'}"]
    run_dir = tmp_path / "run"
    _run([*common, "algorithm.num_steps=2"], run_dir)
    assert (run_dir / "checkpoints" / "step_000002" / "trainer.pt").is_file()
    manifest = json.loads((run_dir / "checkpoints" / "step_000002" / "trainer.pt").read_text())
    assert manifest["step"] == 2 and manifest["files"]
    _run([*common, "algorithm.num_steps=3"], run_dir, resume=True)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert [r["weight_version"] for r in rows] == [1, 2, 3]  # the resume re-synced version 3 first
    for row in rows:
        assert 0.0 <= row["reward"] <= 1.0
        assert row["sync/version"] == row["weight_version"] and row["sync/num_tensors"] > 0
        assert row["train/step"] == row["step"] + 1  # the trainer's own step count, restored on resume
        assert row["mismatch/mean_abs_dlogp"] < 0.1  # trainer and engine score the same bf16 weights
