"""The placement plan end to end on a logical Ray cluster (256 GPUs as a logical resource, 32
simulated nodes): reserve, probe, re-sort, resolve, stand-in workers started with the plan's
options report what they got. One cluster serves the module; its Ray start is the main cost."""

from __future__ import annotations

import pytest
import ray

from skyq import preflight
from skyq.config.resolve import ResolutionError
from skyq.config.store import compose, to_object
from skyq.config.validate import validate
from skyq.dryrun import render_plan
from skyq.launch.plan import ENGINE, TRAINER, plan_placement
from skyq.launch.probe import PlacementError, placement
from skyq.launch.simulate import check, logical_cluster, render, sim_report, simulate

GPUS = 256


@pytest.fixture(scope="module")
def cluster():
    with logical_cluster(GPUS):
        yield


def _cfg(*overrides: str):
    return to_object(compose(list(overrides)))


def _groups_alive() -> int:
    return sum(info["state"] != "REMOVED" for info in ray.util.placement_group_table().values())


def _plan_block(text: str) -> str:
    start = text.index("placement plan:")
    return text[start : text.index("\n\n", start)]


def test_qwen3_8gpu_every_worker_gets_what_the_plan_says(cluster):
    cfg = _cfg("recipe=qwen3_30b_fp8_blockwise_8gpu")
    result = simulate(cfg)
    assert len(result.trainer) == 8 and sorted(result.engines) == [0, 1, 2, 3]
    assert [w["vllm_visible"] for w in result.engines[2]["workers"]] == ["4,5", "4,5"]
    assert result.plan.env(ENGINE, 2)["VLLM_USE_DEEP_GEMM_E8M0"] == "0"  # resolved on the (SM90) probes
    assert (result.resolution.fp8_recipe.value, result.packing_alignment) == ("blockwise", 16)
    assert _groups_alive() == 0
    text = render(result, cfg)
    dry = render_plan(cfg, validate(cfg), preflight.check(cfg))
    assert _plan_block(text) == _plan_block(dry)  # the dry run and the simulation print the same plan


def test_kimi_256gpu_plan_end_to_end(cluster):
    """All 256 trainer ranks; two engines (first and last) with their 32 vLLM-style workers: each
    engine is a Ray worker process of its own, the costly part on two cores."""
    cfg = _cfg("recipe=kimi_k26_int4_qat_256gpu_text")
    result = simulate(cfg, engines=(0, 15))
    assert len(result.trainer) == 256 and len(result.reports) == 256
    assert result.moved > 0  # the simulated nodes' IPs are not in bundle order: the re-sort is at work
    for index in (0, 15):
        workers = result.engines[index]["workers"]
        assert len(workers) == 16 and len({w["where"][0][0] for w in workers}) == 2
        assert {w["vllm_visible"] for w in workers} == {"0,1,2,3,4,5,6,7"}
    assert _groups_alive() == 0


def test_one_gpu_vllm_engines_hold_their_own_gpus(cluster):
    """A one-GPU vLLM engine computes in its actor's process on device 0 (vLLM's uni executor): each
    engine actor is given its own GPU by Ray (CUDA_VISIBLE_DEVICES = that GPU, no NOSET), not left
    to see the whole node and take GPU 0."""
    cfg = _cfg("recipe=qwen3_30b_mxfp8_8gpu", "precision.emulate=true")
    result = simulate(cfg, engines=(0, 5))
    for index in (0, 5):
        seen = result.engines[index]
        assert (seen["where"][0][1], seen["ray_visible"]) == (index, str(index)) and "workers" not in seen
        assert "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES" not in seen["env"]
    assert "vLLM in the actor's process" in render(result, cfg)
    assert _groups_alive() == 0


def test_check_catches_a_worker_on_another_gpu_or_with_another_env(cluster):
    """The check is not vacuous: a stand-in started from a different plan's options fails it."""
    cfg = _cfg("recipe=qwen3_30b_fp8_blockwise_8gpu")  # two-GPU engines: vLLM's Ray workers
    plan = plan_placement(topology=cfg.topology, rollout=cfg.rollout, trainer=cfg.trainer)
    with placement(
        plan, cfg.precision, timeout_s=60, report=sim_report, report_args=(8, (9, 0), {})
    ) as started:
        from skyq.launch.simulate import run_stand_ins

        trainer, engines = run_stand_ins(started, engines=(0,))
        check(started.plan, trainer, engines)
        trainer[3], trainer[4] = trainer[4], trainer[3]
        engines[0]["workers"][0]["env"]["VLLM_RAY_PER_WORKER_GPUS"] = "1"
        with pytest.raises(Exception, match=r"trainer rank 3: on .* slot 3.*engine 0 worker 0: env") as err:
            check(started.plan, trainer, engines)
        assert str(err.value).startswith(
            "5 difference(s) from the plan"
        )  # where + CUDA_VISIBLE_DEVICES x 2, env


def test_mixed_gpu_generations_are_refused_before_any_worker_starts(cluster):
    cfg = _cfg(
        "recipe=qwen3_30b_fp8_blockwise_8gpu",
        "topology.num_nodes=2",
        "topology.trainer_gpus=16",
        "topology.rollout_gpus=16",
    )
    with pytest.raises(ResolutionError, match="workers resolved precision differently"):
        simulate(cfg, capabilities={1: (10, 0)})
    assert _groups_alive() == 0


def test_unsatisfiable_placement_fails_with_what_was_asked_and_what_the_cluster_has(cluster):
    cfg = _cfg(
        "recipe=qwen3_30b_fp8_blockwise_8gpu",
        "topology.num_nodes=33",
        "topology.trainer_gpus=264",
        "topology.rollout_gpus=264",
        "topology.placement_timeout_s=1",
    )
    plan = plan_placement(topology=cfg.topology, rollout=cfg.rollout, trainer=cfg.trainer)
    with pytest.raises(PlacementError) as err:
        with placement(
            plan,
            cfg.precision,
            timeout_s=cfg.topology.placement_timeout_s,
            report=sim_report,
            report_args=(8, (9, 0), {}),
        ):
            pass
    message = str(err.value)
    assert "not ready within 1 s (topology.placement_timeout_s): asked 264 bundles" in message
    assert "= 264 GPU 264 CPU" in message and f"the cluster has {GPUS} GPU" in message
    assert _groups_alive() == 0


def test_the_placement_group_is_removed_when_the_start_fails(cluster):
    cfg = _cfg("recipe=qwen3_30b_mxfp8_8gpu", "precision.emulate=true")
    plan = plan_placement(topology=cfg.topology, rollout=cfg.rollout, trainer=cfg.trainer)
    with pytest.raises(RuntimeError, match="worker failed to start"):
        with placement(
            plan, cfg.precision, timeout_s=60, report=sim_report, report_args=(8, (9, 0), {})
        ) as started:
            assert _groups_alive() == 1 and started.actor_options(TRAINER, 0)["num_gpus"] == 0.4
            raise RuntimeError("worker failed to start")
    assert _groups_alive() == 0


def test_the_sweep_removes_what_a_job_left_in_its_ray_session(cluster):
    """The sweep's backstop at a job's end: a placement group and an actor a job left behind are
    removed, and the session is kept for the next job (which finds it empty)."""
    from omegaconf import OmegaConf
    from ray.util.placement_group import placement_group

    from skyq.sweep import SweepRaySession, leftovers

    job = OmegaConf.create(
        {"dry_run": False, "simulate": True, "topology": {"num_nodes": 1, "gpus_per_node": 8}}
    )
    session = SweepRaySession()
    session.before_job(job, 0)
    leaked_group = placement_group([{"GPU": 1, "CPU": 1}] * 2)
    ray.get(leaked_group.ready(), timeout=60)
    leaked_actor = ray.remote(num_cpus=0)(type("Leaked", (), {"ping": lambda self: 1})).remote()
    ray.get(leaked_actor.ping.remote(), timeout=60)
    assert [len(ids) for ids in leftovers()] == [1, 1]
    session.after_job(0)
    assert leftovers() == ([], []) and session.kind == ("logical", 8)
    session.before_job(job, 1)
    assert session.started_for == 0 and ray.is_initialized()
    session.close()
    assert ray.is_initialized()  # the module's cluster: the session did not start it, so it does not stop it
