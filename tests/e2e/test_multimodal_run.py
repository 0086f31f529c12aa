"""The multimodal recipe end to end on the CPU, as a user runs it: `skyq.tools.make_dot_count` writes the
synthetic dot-count task (open-r1 JSONL, image paths) and the random-init tiny Kimi-K2.6 with its vision
tower; `recipe=tiny_kimi_vl_int4_qat_cpu_dots` trains it with GRPO through real Ray actors. The images
reach the engine and the trainer (a mismatch this small is only possible when both see them: scored
blind it is 10x larger, tests/rollout/test_multimodal_engine.py), every sync is accounted (the plan's
wire tensors, the tower's and projector's bf16 ones included), and over the recipe's 400 steps the reward
rises above chance."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from skyq.config.store import compose, to_object
from skyq.config.validate import ConfigValidationError, validate
from skyq.launch.loop import check_supported
from skyq.quant.layouts import vision
from skyq.quant.plan import build_plan
from skyq.tools import make_dot_count

RECIPE = "tiny_kimi_vl_int4_qat_cpu_dots"


@pytest.fixture(scope="module")
def dots(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("dots")
    assert make_dot_count.main([str(root), "--rows", "24"]) == 0
    return root


def _train(dots: Path, runs: Path, *extra: str) -> list[dict]:
    args = [
        f"recipe={RECIPE}", f"checkpoint.hf_checkpoint={dots / 'checkpoint'}", f"task.dataset={dots / 'dots.jsonl'}",
        f"output_root={runs}", "logger.progress_bar=false", "logger.plot=false", *extra,
    ]  # fmt: skip
    out = subprocess.run(
        [sys.executable, "-m", "skyq.train", *args],
        capture_output=True,
        text=True,
        cwd=runs.parent,
        timeout=900,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    (run_dir,) = [p for p in runs.iterdir() if p.is_dir()]
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_the_recipe_trains_on_images_with_every_sync_accounted(dots, tmp_path):
    rows = _train(dots, tmp_path / "runs", "algorithm.num_steps=3", "checkpoint.save_interval=0")
    cfg = to_object(compose([f"recipe={RECIPE}", "checkpoint.hf_checkpoint=x", "task.dataset=x"]))
    wire = [w for p in build_plan(cfg.model, cfg.precision) for w in p.wire]
    assert sum(vision.is_vision_name(w.name) and w.dtype == torch.bfloat16 for w in wire) == len(
        vision.vision_names(cfg.model)
    )
    assert [r["step"] for r in rows] == [0, 1, 2] and [r["weight_version"] for r in rows] == [1, 2, 3]
    for row in rows:
        assert 0.0 <= row["reward"] <= 1.0 and math.isfinite(row["loss"])
        assert row["sync/version"] == row["weight_version"]
        assert (row["sync/num_tensors"], row["sync/bytes"]) == (len(wire), sum(w.nbytes for w in wire))
        assert row["mismatch/mean_abs_dlogp"] < 0.005


def test_only_the_pair_that_takes_images_runs_a_multimodal_task():
    base = [f"recipe={RECIPE}", "checkpoint.hf_checkpoint=x", "task.dataset=x"]
    with pytest.raises(ConfigValidationError, match="task.image_key=image is read only by trainer=torch / "):
        validate(to_object(compose([*base, "rollout=vllm"])))
    cfg = to_object(compose([*base, "trainer=megatron"]))
    with pytest.raises(ValueError, match="trainer=megatron rollout=embedded is not given a prompt's images"):
        check_supported(rollout=cfg.rollout, trainer=cfg.trainer, algorithm=cfg.algorithm, task=cfg.task)
    check_supported(rollout=cfg.rollout, trainer=cfg.trainer, algorithm=cfg.algorithm)  # a text task runs


@pytest.mark.slow  # the recipe's 400 GRPO steps: ~90 s on a 2-core CPU
def test_the_reward_rises_above_chance(dots, tmp_path):
    """Answering one count for every image scores 1/3; well above that, the policy reads the images."""
    rows = _train(dots, tmp_path / "runs", "checkpoint.save_interval=0")
    rewards = [r["reward"] for r in rows]
    first, last = sum(rewards[:40]) / 40, sum(rewards[-40:]) / 40
    assert first < 0.2 and last > 0.5, (first, last)


def test_make_dot_count_refuses_bad_arguments_before_writing(tmp_path, capsys):
    from skyq.tools.cli import run_tool

    assert run_tool(make_dot_count.main, [str(tmp_path / "out"), "--max-dots", "10"]) == 2
    assert "--max-dots=10 in 1..9" in capsys.readouterr().err and not (tmp_path / "out").exists()
