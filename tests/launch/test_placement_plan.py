"""The placement planner (pure): the seeds' layouts, the split layout's node packing, the refusals,
the probe's re-sort and per-GPU resolution, and what `actor_options` hands Ray."""

from __future__ import annotations

import dataclasses
import random
from collections import Counter

import pytest

from skyq.config.resolve import ResolutionError
from skyq.config.store import compose, to_object
from skyq.launch.plan import ENGINE, ENGINE_WORKER, TRAINER, PlanError, plan_placement
from skyq.launch.probe import PlacementError, ProbeReport, bind, resolve


def _cfg(*overrides: str):
    return to_object(compose(list(overrides)))


def _plan(cfg):
    return plan_placement(topology=cfg.topology, rollout=cfg.rollout, trainer=cfg.trainer)


def _reports(num_nodes: int, gpn: int, ip=lambda n: f"10.0.{n}.1", cap=lambda n: (9, 0)) -> list[ProbeReport]:
    """Probe reports of a cluster of `num_nodes` x `gpn`, bundles in a shuffled order."""
    cells = [(n, g) for n in range(num_nodes) for g in range(gpn)]
    random.Random(0).shuffle(cells)
    return [ProbeReport(b, ip(n), f"host{n}", g, cap(n)) for b, (n, g) in enumerate(cells)]


def test_kimi_256gpu_plan_places_every_rank_and_engine_on_whole_nodes():
    plan = _plan(_cfg("recipe=kimi_k26_int4_qat_256gpu_text"))
    assert plan.num_slots == 256 and plan.parallel == (8, 8, 4, 1)
    assert sorted(r.slot for r in plan.trainer) == list(range(256))
    # Megatron order: a TP group is 8 consecutive ranks on one node.
    for tp_group in range(32):
        ranks = plan.trainer[tp_group * 8 : tp_group * 8 + 8]
        assert [r.tp for r in ranks] == list(range(8)) and len({plan.node(r.slot) for r in ranks}) == 1
    assert Counter((r.cp, r.dp, r.pp) for r in plan.trainer).most_common(1)[0][1] == 8
    assert len(plan.engines) == 16
    worker_slots = [s for e in plan.engines for s in e.slots]
    assert sorted(worker_slots) == list(range(256))
    for e in plan.engines:
        assert e.slots[0] % 8 == 0 and len({plan.node(s) for s in e.slots}) == 2
        assert e.node_groups == (tuple(range(8)), tuple(range(8, 16)))
        assert (e.sync_world_size, e.sync_rank_offset, e.global_sync_rank_offset) == (17, 1, 1 + 16 * e.index)
    env = plan.env(ENGINE, 3)
    assert env["VLLM_RAY_BUNDLE_INDICES"] == ",".join(str(s) for s in range(48, 64))
    assert (
        env["VLLM_RAY_PER_WORKER_GPUS"] == "0.2" and env["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"] == "1"
    )
    assert plan.visible_devices(ENGINE_WORKER, 3 * 16 + 9) == "0,1,2,3,4,5,6,7"  # worker 9: node 7
    assert plan.visible_devices(TRAINER, 13) == "5" and plan.visible_devices(ENGINE, 3) is None


@pytest.mark.parametrize(
    "recipe, engines, gpe",
    [
        ("qwen3_30b_fp8_blockwise_8gpu", 4, 2),
        ("qwen3_30b_int4_qat_8gpu", 4, 2),
        ("qwen3_30b_mxfp8_8gpu", 8, 1),
    ],
)
def test_qwen3_8gpu_plans_colocate_trainer_and_engines(recipe, engines, gpe):
    plan = _plan(_cfg(f"recipe={recipe}"))
    assert [r.slot for r in plan.trainer] == list(range(8)) and plan.parallel == (1, 1, 1, 8)
    assert [e.slots for e in plan.engines] == [tuple(range(i * gpe, i * gpe + gpe)) for i in range(engines)]
    assert plan.num_gpus(TRAINER) + plan.num_gpus(ENGINE_WORKER) <= 1
    assert plan.num_gpus(ENGINE) == (0 if gpe > 1 else 0.2)  # a one-GPU engine holds its GPU share itself
    assert plan.visible_devices(ENGINE_WORKER, 2 * gpe) == ",".join(str(2 * gpe + w) for w in range(gpe))


SPLIT_2x8 = [
    "topology=8gpu", "topology.num_nodes=2", "topology.placement=split", "topology.trainer_gpus=4", "trainer=megatron",
]  # fmt: skip


def test_split_layout_packs_engines_per_node_after_the_trainer_gpus():
    plan = _plan(_cfg(*SPLIT_2x8, "topology.rollout_gpus=12", "rollout=vllm", "rollout.gpus_per_engine=4"))
    assert [r.slot for r in plan.trainer] == [0, 1, 2, 3]
    assert [e.slots for e in plan.engines] == [(4, 5, 6, 7), (8, 9, 10, 11), (12, 13, 14, 15)]
    assert plan.num_gpus(TRAINER) == plan.num_gpus(ENGINE_WORKER) == 1


def test_an_engine_that_would_straddle_two_nodes_is_refused():
    # 3-GPU engines over node 0's GPUs 4-7 and node 1's 8-15: 3 fit, a 4th would cross nodes.
    base = [*SPLIT_2x8, "topology.rollout_gpus=12", "rollout=vllm", "rollout.gpus_per_engine=3"]
    with pytest.raises(PlanError, match=r"straddling two nodes: 3 fit\. Fix: rollout\.num_engines <= 3"):
        _plan(_cfg(*base, "rollout.num_engines=4"))
    plan = _plan(_cfg(*base, "rollout.num_engines=3"))
    assert [e.slots for e in plan.engines] == [(4, 5, 6), (8, 9, 10), (11, 12, 13)]


def test_an_engine_wider_than_a_node_must_be_whole_nodes():
    cfg = _cfg("recipe=kimi_k26_int4_qat_256gpu_text", "rollout.gpus_per_engine=12", "rollout.num_engines=2")
    with pytest.raises(PlanError, match="rollout.gpus_per_engine=12 is wider than a node"):
        _plan(cfg)


def test_a_user_env_entry_for_a_variable_the_plan_sets_is_refused():
    with pytest.raises(PlanError, match=r"rollout\.env sets VLLM_RAY_BUNDLE_INDICES"):
        _plan(_cfg("recipe=qwen3_30b_mxfp8_8gpu", "+rollout.env.VLLM_RAY_BUNDLE_INDICES=0"))


def test_bind_sorts_bundles_by_numeric_node_ip_then_gpu():
    plan = _plan(_cfg("recipe=kimi_k26_int4_qat_256gpu_text"))
    # 10.0.10.1 sorts before 10.0.9.1 as text; the hardware order is numeric.
    reports = _reports(32, 8)
    bound = bind(plan, reports)
    by_bundle = {r.bundle: r for r in reports}
    assert [(by_bundle[b].node_ip, by_bundle[b].gpu_id) for b in bound.slot_bundle] == [
        (f"10.0.{n}.1", g) for n in range(32) for g in range(8)
    ]
    assert bound.slot_bundle != tuple(range(256))
    options = bound.actor_options(TRAINER, 77, placement_group=object())
    assert options["scheduling_strategy"].placement_group_bundle_index == bound.slot_bundle[77]
    assert bound.env(ENGINE, 0)["VLLM_RAY_BUNDLE_INDICES"] == ",".join(str(b) for b in bound.slot_bundle[:16])


def test_bind_refuses_a_group_that_is_not_whole_nodes():
    plan = _plan(_cfg("recipe=qwen3_30b_mxfp8_8gpu"))
    reports = [ProbeReport(b, "10.0.0.1" if b < 6 else "10.0.0.2", "h", b % 6, (9, 0)) for b in range(8)]
    with pytest.raises(PlacementError, match=r"landed on 2 node\(s\) \(10\.0\.0\.1: 6, 10\.0\.0\.2: 2\)"):
        bind(plan, reports)


def test_resolution_per_gpu_refuses_mixed_generations_and_merges_the_agreed_env():
    cfg = _cfg(
        "recipe=qwen3_30b_fp8_blockwise_8gpu",
        "topology.num_nodes=2",
        "topology.trainer_gpus=16",
        "topology.rollout_gpus=16",
    )
    plan = _plan(cfg)
    mixed = _reports(2, 8, cap=lambda n: (9, 0) if n == 0 else (10, 0))
    with pytest.raises(ResolutionError, match="workers resolved precision differently"):
        resolve(bind(plan, mixed), mixed, cfg.precision)
    hopper = _reports(2, 8)
    bound, agreed = resolve(bind(plan, hopper), hopper, cfg.precision)
    assert (agreed.fp8_recipe.value, agreed.scale_format.value) == ("blockwise", "fp32")
    engine_env = bound.env(ENGINE, 1)
    assert engine_env["NCCL_NVLS_ENABLE"] == "0" and engine_env["VLLM_USE_DEEP_GEMM_E8M0"] == "0"
    assert bound.env(TRAINER, 5)["NVTE_FP8_BLOCK_SCALING_FP32_SCALES"] == "1"
    # Not secret: the resolution's variables travel in runtime_env, set when the process starts.
    assert "VLLM_USE_DEEP_GEMM_E8M0" in bound.actor_options(ENGINE, 1, object())["runtime_env"]["env_vars"]


def test_mxfp8_on_hopper_names_the_gpu_that_cannot_run_it():
    cfg = _cfg("recipe=qwen3_30b_mxfp8_8gpu")
    reports = _reports(1, 8)
    with pytest.raises(ResolutionError, match=r"slot 0 \(node 10\.0\.0\.1 host0, GPU 0\).*MXFP8 needs SM100"):
        resolve(bind(_plan(cfg), reports), reports, cfg.precision)


def test_secret_user_env_stays_out_of_ray_runtime_env():
    plan = _plan(
        _cfg(
            "recipe=qwen3_30b_fp8_blockwise_8gpu",
            "+rollout.env.HF_TOKEN=s3cret",
            "+trainer.env.NCCL_DEBUG=INFO",
        )
    )
    options = plan.actor_options(ENGINE, 2, object())
    assert "HF_TOKEN" not in options["runtime_env"]["env_vars"] and plan.secret_env(ENGINE, 2) == {
        "HF_TOKEN": "s3cret"
    }
    assert plan.env(ENGINE_WORKER, 5)["HF_TOKEN"] == "s3cret"  # engine 2's second vLLM worker
    assert plan.actor_options(TRAINER, 0, object())["runtime_env"]["env_vars"] == {"NCCL_DEBUG": "INFO"}
    assert options["num_gpus"] == 0 and options["scheduling_strategy"].placement_group_capture_child_tasks


def test_cpu_plan_gives_each_rank_and_engine_a_cpu_bundle_within_two_cpus():
    plan = _plan(_cfg("topology=cpu", "trainer=megatron", "topology.parallel.tp=2", "rollout.num_engines=3"))
    assert plan.bundles == [{"CPU": 0.5}] * 2 + [{"CPU": 0.3333}] * 3  # the local cluster's two CPUs
    assert [r.slot for r in plan.trainer] == [0, 1] and [e.slots for e in plan.engines] == [(2,), (3,), (4,)]
    options = plan.actor_options(TRAINER, 1, placement_group=object())
    assert (options["num_cpus"], options["num_gpus"]) == (0.5, 0)
    assert options["scheduling_strategy"].placement_group_bundle_index == 1
    engine = plan.actor_options(ENGINE, 2, placement_group=object())
    assert (engine["num_cpus"], engine["scheduling_strategy"].placement_group_bundle_index) == (0.3333, 4)
    with pytest.raises(ValueError, match="need the plan's placement group"):
        plan.actor_options(TRAINER, 0)


def test_the_native_trainer_is_one_rank_whatever_the_trainer_gpus():
    plan = _plan(_cfg("topology=8gpu", "topology.placement=split", "topology.trainer_gpus=4",
                      "topology.rollout_gpus=4"))  # fmt: skip
    assert [r.slot for r in plan.trainer] == [0] and plan.parallel == (1, 1, 1, 1)
    assert [e.slots for e in plan.engines] == [(4,), (5,), (6,), (7,)]


PLAN_VLLM_ENV = {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES", "VLLM_RAY_BUNDLE_INDICES", "VLLM_RAY_PER_WORKER_GPUS"}  # fmt: skip


@pytest.mark.parametrize(
    "overrides, engine, slot, share, gpu",
    [
        (["topology=8gpu", "rollout=vllm"], 5, 5, 0.2, 5),  # colocated: 8 engines beside the trainer
        ([*SPLIT_2x8, "topology.rollout_gpus=12", "rollout=vllm"], 7, 11, 1, 3),  # after 4 trainer GPUs
    ],
)
def test_a_one_gpu_vllm_engine_holds_its_own_gpu_on_a_multi_gpu_node(overrides, engine, slot, share, gpu):
    """vLLM runs a world-1 engine in the calling process on device 0 (its uni executor, no Ray
    worker): the engine actor itself holds its GPU share, without NOSET, so Ray's
    CUDA_VISIBLE_DEVICES makes device 0 the plan's GPU; nothing is left to vLLM's Ray executor."""
    plan = _plan(_cfg(*overrides))
    assert not plan.vllm_ray_workers and plan.engines[engine].slots == (slot,)
    options = plan.actor_options(ENGINE, engine, object())
    assert (options["num_gpus"], options["scheduling_strategy"].placement_group_bundle_index) == (share, slot)
    assert not PLAN_VLLM_ENV & set(plan.env(ENGINE, engine)) and "runtime_env" not in options
    w = plan.worker(ENGINE, engine)
    assert (w.gpu, w.num_gpus, w.visible_devices, w.sync_world_size, w.sync_rank) == (
        gpu,
        share,
        str(gpu),
        2,
        1,
    )
    assert plan.worker(ENGINE_WORKER, engine) == dataclasses.replace(w, role=ENGINE_WORKER)
    bound = bind(plan, _reports(plan.num_nodes, 8))  # the probe's re-sort moves the bundle, not the GPU
    assert bound.visible_devices(ENGINE, engine) == str(gpu)
    placed = bound.actor_options(ENGINE, engine, object())["scheduling_strategy"]
    assert placed.placement_group_bundle_index == bound.slot_bundle[slot] != slot


def test_a_two_gpu_vllm_engine_leaves_its_gpus_to_vllms_ray_workers():
    plan = _plan(_cfg("topology=8gpu", "rollout=vllm", "rollout.gpus_per_engine=2"))
    assert plan.vllm_ray_workers and plan.num_gpus(ENGINE) == 0 and plan.visible_devices(ENGINE, 2) is None
    env = plan.env(ENGINE, 2)
    assert (env["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"], env["VLLM_RAY_BUNDLE_INDICES"]) == (
        "1",
        "4,5",
    )
    assert env["VLLM_RAY_PER_WORKER_GPUS"] == "0.2" and plan.visible_devices(ENGINE_WORKER, 5) == "4,5"
    assert plan.worker(ENGINE, 2).sync_rank is None and plan.worker(ENGINE_WORKER, 5).sync_rank == 2


def test_one_gpu_colocated_puts_trainer_and_engine_on_one_bundle_with_fractions():
    plan = _plan(_cfg("topology=1gpu", "trainer=megatron"))
    assert plan.bundles == [{"GPU": 1, "CPU": 1}]
    trainer, engine = plan.worker(TRAINER, 0), plan.worker(ENGINE, 0)
    assert (trainer.bundle, engine.bundle) == (0, 0)
    assert (trainer.num_gpus, engine.num_gpus) == (0.4, 0.2)
    vllm = _plan(_cfg("topology=1gpu", "trainer=megatron", "rollout=vllm")).worker(ENGINE, 0)
    assert (vllm.bundle, vllm.num_gpus, vllm.visible_devices, vllm.env) == (0, 0.2, "0", {})


def test_dry_run_prints_the_plan():
    from skyq import preflight
    from skyq.config.validate import validate
    from skyq.dryrun import render_plan
    from skyq.launch.placement import describe_plan

    cfg = _cfg("recipe=kimi_k26_int4_qat_256gpu_text")
    text = render_plan(cfg, validate(cfg), preflight.check(cfg))
    assert describe_plan(_plan(cfg)) in text and "engine 15: slots 240-255 (node 30-31" in text


def test_worker_gathers_one_workers_placement():
    plan = bind(_plan(_cfg("recipe=kimi_k26_int4_qat_256gpu_text")), _reports(32, 8))
    w = plan.worker(ENGINE_WORKER, 5 * 16 + 11)  # engine 5, worker 11: slot 91 = node 11, GPU 3
    assert (w.slot, w.node, w.node_ip, w.gpu, w.num_gpus) == (91, 11, "10.0.11.1", 3, 0.2)
    assert w.bundle == plan.slot_bundle[91] and w.visible_devices == "0,1,2,3,4,5,6,7"
    assert (w.sync_world_size, w.sync_rank) == (17, 12)
    assert w.env["VLLM_RAY_BUNDLE_INDICES"] == plan.env(ENGINE, 5)["VLLM_RAY_BUNDLE_INDICES"]
    sender = plan.worker(TRAINER, 0)
    assert (sender.sync_world_size, sender.sync_rank, sender.num_gpus, sender.visible_devices) == (
        17,
        0,
        0.4,
        "0",
    )
    assert plan.worker(TRAINER, 1).sync_rank is None and plan.worker(ENGINE, 5).num_gpus == 0


def test_validation_reports_the_plans_refusal_before_anything_starts(tmp_path):
    import subprocess
    import sys

    from skyq.config.validate import ConfigValidationError, validate

    straddle = [*SPLIT_2x8, "topology.rollout_gpus=12", "rollout=vllm", "rollout.gpus_per_engine=3",
                "rollout.num_engines=4", "topology.parallel.ep=1", "precision=bf16"]  # fmt: skip
    with pytest.raises(PlanError) as planned:
        _plan(_cfg(*straddle))
    with pytest.raises(ConfigValidationError) as refused:
        validate(_cfg(*straddle))
    assert refused.value.errors == [str(planned.value)]  # one error, in the planner's words
    out = subprocess.run(
        [sys.executable, "-m", "skyq.train", *straddle, "dry_run=true", f"output_root={tmp_path}"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert "straddling two nodes: 3 fit. Fix: rollout.num_engines <= 3" in out.stderr
    assert list(tmp_path.iterdir()) == []  # nothing started, nothing written


def test_the_runs_local_cluster_has_a_cpu_for_every_gpu_bundle():
    from skyq.launch.loop import local_cpus

    assert local_cpus(_plan(_cfg("recipe=qwen3_30b_mxfp8_8gpu"))) == 8  # was 2: 8 bundles never ready
    assert local_cpus(_plan(_cfg("topology=cpu", "rollout.num_engines=3"))) == 2
    assert local_cpus(_plan(_cfg("topology=1gpu", "trainer=megatron"))) == 2
