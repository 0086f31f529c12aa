"""The run loop's seams: the backend registry, the worker protocols, and a rollout group of two engines.

The two-engine run is real: a loopback Ray cluster, one trainer actor and two embedded engine actors,
each joined to the trainer by its own gloo sync group, every sync verified by each engine."""

from __future__ import annotations

import pytest
import ray

from skyq.config.enums import RolloutBackend, TrainerBackend
from skyq.launch import loop
from skyq.launch.actors import EngineWorker, TrainerWorker
from skyq.launch.metrics import read_metrics
from skyq.launch.pair import engine_seed
from skyq.launch.protocols import (
    RolloutWorkerApi,
    TrainerWorkerApi,
    check_conforms,
    conformance_problems,
)
from skyq.launch.ray_local import local_ray
from skyq.launch.registry import WorkerBackends, lookup, register, registered
from skyq.launch.rundir import METRICS_FILE

from .run_helpers import run


def test_every_registered_backend_pair_implements_the_worker_protocols():
    for trainer, rollout in registered():
        backends = lookup(trainer, rollout)
        check_conforms(backends.trainer_class(), TrainerWorkerApi, "trainer worker")
        check_conforms(backends.engine_class(), RolloutWorkerApi, "rollout worker")
    assert (TrainerBackend.torch, RolloutBackend.embedded) in registered()


def test_a_pair_with_no_workers_is_refused_naming_what_runs(monkeypatch):
    """Every pair of today's backends is registered; one taken out stands for a backend without workers."""
    from skyq.launch import registry

    assert len(registered()) == len(TrainerBackend) * len(RolloutBackend)
    monkeypatch.delitem(registry._REGISTRY, (TrainerBackend.megatron, RolloutBackend.vllm))
    with pytest.raises(
        ValueError, match="trainer=megatron rollout=vllm: this build of skyq has no workers"
    ) as err:
        lookup(TrainerBackend.megatron, RolloutBackend.vllm)
    assert "trainer=torch rollout=embedded" in str(err.value)


class _EngineMissingAMethod(EngineWorker):
    wire_digest = None  # type: ignore[assignment]


class _EngineWithAnOldSignature:
    def generate(self, prompts, n, max_new_tokens):  # no temperature / top_p / seed
        return []


def test_a_class_that_does_not_implement_the_protocol_is_refused_when_loaded(monkeypatch):
    assert conformance_problems(EngineWorker, RolloutWorkerApi) == []
    assert conformance_problems(TrainerWorker, TrainerWorkerApi) == []
    assert "_EngineMissingAMethod has no `wire_digest`" in conformance_problems(
        _EngineMissingAMethod, RolloutWorkerApi
    )
    problems = conformance_problems(_EngineWithAnOldSignature, RolloutWorkerApi)
    assert "_EngineWithAnOldSignature.generate does not take `seed`" in problems
    assert "_EngineWithAnOldSignature has no `receive_weights`" in problems
    # Registered under a real pair, it fails at load time, before any actor starts.
    import skyq.launch.registry as registry

    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    register(
        TrainerBackend.torch,
        RolloutBackend.vllm,
        WorkerBackends(
            trainer="skyq.launch.actors:TrainerWorker",
            engine=f"{__name__}:_EngineWithAnOldSignature",
            trainer_kwargs="skyq.launch.pair:native_trainer_kwargs",
            engine_kwargs="skyq.launch.pair:embedded_engine_kwargs",
        ),
    )
    with pytest.raises(TypeError, match="rollout worker .*_EngineWithAnOldSignature does not implement"):
        lookup(TrainerBackend.torch, RolloutBackend.vllm).engine_class()


def test_engine_seeds_keep_engine_zero_on_the_step_seed():
    assert engine_seed(1234, 0) == 1234
    seeds = {engine_seed(1234, i) for i in range(8)}
    assert len(seeds) == 8 and all(0 <= s < 2**63 for s in seeds)


@pytest.fixture(scope="module")
def cluster():
    assert not ray.is_initialized(), "another test module left Ray running"
    with local_ray():
        yield


def test_two_engines_each_verify_every_sync_and_share_the_rollout(
    cluster, base_overrides, tmp_path, monkeypatch
):
    """rollout.num_engines=2: each engine receives, verifies and commits every version (the first sync
    of the run is compared bit for bit on both), the step's prompts are split between them, and the run
    learns as a one-engine run does."""
    generated: list[int] = []
    real_generate = loop.WorkerPair.generate

    def counting_generate(self, prompts, **sampling):
        samples = real_generate(self, prompts, **sampling)
        generated.append(len(samples))
        assert self.num_engines == 2
        return samples

    verified: list[int] = []
    real_verify = loop.WorkerPair.verify_engine_matches_trainer

    def counting_verify(self):
        real_verify(self)
        verified.append(self.num_engines)

    monkeypatch.setattr(loop.WorkerPair, "generate", counting_generate)
    monkeypatch.setattr(loop.WorkerPair, "verify_engine_matches_trainer", counting_verify)
    result = run([*base_overrides, "rollout.num_engines=2", "algorithm.num_steps=3"], tmp_path / "two")
    rows = read_metrics(tmp_path / "two" / METRICS_FILE)
    assert [r["weight_version"] for r in rows] == [1, 2, 3]
    assert result.weight_version == 3
    assert verified == [2]  # both engines compared with the trainer after the first sync
    assert generated == [64, 64, 64]  # global_batch_size samples a step, from both engines
    assert all(r["sync/bytes"] > 0 for r in rows)
