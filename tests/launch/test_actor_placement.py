"""The real Ray pair places its workers through the placement plan, on the CPU: the Megatron trainer
(TP2: rank 0 is the trainer actor, rank 1 a peer it starts) and two embedded engines each sit in the
plan's one placement group on the bundle the plan gave them, start with the plan's env, and the
group is gone after the pair, after a pair whose start failed, and after a whole run, which prints
the plan the dry run prints."""

from __future__ import annotations

import contextlib
import io
import sys

import pytest
import ray
from ray import cloudpickle

from skyq.launch.actor_pair import ActorPair
from skyq.launch.loop import _starting_checkpoint
from skyq.launch.pair import PairSpec
from skyq.launch.placement import run_placement, run_plan
from skyq.launch.plan import ENGINE, TRAINER
from skyq.launch.ray_local import local_ray
from skyq.rl.tokenizer import EOS_ID

from .run_helpers import compose_config, run

MEGATRON_TP2 = [
    "trainer=megatron",
    "precision=bf16",
    "topology.parallel.tp=2",
    "topology.parallel.etp=2",
    "topology.parallel.sequence_parallel=true",
    "rollout.num_engines=2",
]
PUBLIC_ENV = ["+trainer.env.NCCL_DEBUG=INFO", "+rollout.env.NCCL_DEBUG=WARN"]

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the actors cannot import the tests


@pytest.fixture(scope="module")
def cluster():
    assert not ray.is_initialized(), "another test module left Ray running"
    with local_ray():
        yield


def _groups_alive() -> int:
    return sum(info["state"] != "REMOVED" for info in ray.util.placement_group_table().values())


def _spec(cfg) -> PairSpec:
    placement = run_placement(cfg.topology, cfg.trainer, cfg.rollout)
    return PairSpec(
        model=cfg.model, precision=cfg.precision, algorithm=cfg.algorithm, trainer=cfg.trainer,
        rollout=cfg.rollout, placement=placement,
        checkpoint_path=_starting_checkpoint(cfg.model, cfg.task, cfg.checkpoint, placement.device),
        seed=cfg.seed, eos_token_id=EOS_ID, parallel=cfg.topology.parallel,
        trainer_gpus=cfg.topology.trainer_gpus, checkpoint=cfg.checkpoint, rollout_checkpoint=cfg.checkpoint.rollout_checkpoint,
    )  # fmt: skip


def where_am_i() -> dict:
    """Inside an actor: its placement group, the bundle its resources come from, its env."""
    import os

    import ray

    group = ray.util.get_current_placement_group()
    # The raw resource ids (the public get_assigned_resources folds them back to plain names): Ray
    # names a bundle's resources <resource>_group_<bundle index>_<group id>.
    raw = ray._private.worker.global_worker.core_worker.resource_ids()
    bundles = {
        int(index)
        for name in raw
        if "_group_" in name and (index := name.split("_group_")[1].split("_")[0]).isdigit()
    }
    return {
        "group": None if group is None else group.id.hex(),
        "bundles": bundles,
        "NCCL_DEBUG": os.environ.get("NCCL_DEBUG"),
    }


def _peer_where(trainer_worker) -> dict:
    """In the Megatron trainer actor: where its peer rank 1 is (asked of the peer itself)."""
    (peer,) = trainer_worker.group.peers
    return ray.get(peer.__ray_call__.remote(lambda _: where_am_i()), timeout=60)


def test_every_worker_sits_on_its_planned_bundle_with_the_plans_env(cluster, base_overrides):
    cfg, _ = compose_config([*base_overrides, *MEGATRON_TP2, *PUBLIC_ENV])
    plan = run_plan(cfg.topology, cfg.trainer, cfg.rollout)
    assert [r.slot for r in plan.trainer] == [0, 1] and [e.slots for e in plan.engines] == [(2,), (3,)]
    pair = ActorPair(_spec(cfg), plan)
    try:
        started = pair.started
        group = started.placement_group.id.hex()
        assert pair.num_engines == 2
        where = {
            (TRAINER, 0): ray.get(pair.trainer.__ray_call__.remote(lambda _: where_am_i()), timeout=60),
            (TRAINER, 1): ray.get(pair.trainer.__ray_call__.remote(_peer_where), timeout=60),
            **{
                (ENGINE, i): ray.get(e.__ray_call__.remote(lambda _: where_am_i()), timeout=60)
                for i, e in enumerate(pair.engines)
            },
        }
        for (role, index), got in where.items():
            assert got["group"] == group, (role, index)
            assert got["bundles"] == {started.plan.worker(role, index).bundle}, (role, index, got)
            assert got["NCCL_DEBUG"] == started.plan.env(role, index)["NCCL_DEBUG"], (role, index)
        assert [where[(ENGINE, i)]["bundles"] for i in range(2)] == [{2}, {3}]
        assert where[(TRAINER, 1)]["NCCL_DEBUG"] == "INFO" and where[(ENGINE, 0)]["NCCL_DEBUG"] == "WARN"
        assert pair.sync(1)["sync/total_s"] >= 0  # the pair works where the plan put it
    finally:
        pair.shutdown()
    assert ray.util.placement_group_table(started.placement_group)["state"] == "REMOVED"
    assert _groups_alive() == 0


def test_a_pair_whose_start_fails_leaves_no_placement_group(cluster, base_overrides, tmp_path):
    cfg, _ = compose_config([*base_overrides, f"checkpoint.rollout_checkpoint={tmp_path / 'absent'}"])
    printed = io.StringIO()
    with pytest.raises(Exception, match="absent"), contextlib.redirect_stdout(printed):
        ActorPair(_spec(cfg), run_plan(cfg.topology, cfg.trainer, cfg.rollout))
    assert "start-up: placement group of 2 bundle(s) ready" in printed.getvalue()  # it was reserved
    assert _groups_alive() == 0


def test_a_run_prints_the_dry_runs_plan_and_removes_its_group(cluster, base_overrides, tmp_path):
    from skyq import preflight
    from skyq.config.validate import validate
    from skyq.dryrun import render_plan
    from skyq.launch.placement import describe_plan

    overrides = [
        *base_overrides,
        "rollout.num_engines=2",
        "algorithm.num_steps=1",
        "checkpoint.save_interval=0",
    ]
    cfg, _ = compose_config(overrides)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        run(overrides, tmp_path / "run")
    planned = describe_plan(run_plan(cfg.topology, cfg.trainer, cfg.rollout))
    assert "rollout: 2 embedded engine(s) on bundles 1-2, 0.5 CPU each" in planned
    assert planned in printed.getvalue()
    assert planned in render_plan(cfg, validate(cfg), preflight.check(cfg))
    assert _groups_alive() == 0
