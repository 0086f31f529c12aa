"""A whole CPU run losing a node, then `resume=`: two Ray nodes on this machine
(`ray.cluster_utils.Cluster`, one logical CPU each), so the CPU plan's two bundles (the trainer's 1
CPU, the engine's 1 CPU) land one per node. After two steps (each checkpointed) the node that does
not hold the driver is removed: the run stops with the placement error naming the lost node and the
worker that was on it, and its group is gone. With a node back, `resume=` continues from the last
checkpoint to the end, the metrics rows one per step."""

from __future__ import annotations

import json

import pytest
import ray

import skyq.launch.loop as loop
from skyq.launch.probe import PlacementError

from .run_helpers import run, two_ray_nodes

NUM_STEPS, LOST_AT = 3, 2


@pytest.fixture()
def two_nodes():
    with two_ray_nodes() as nodes:
        yield nodes


def test_a_run_that_loses_a_node_stops_naming_it_and_resume_finishes_it(
    two_nodes, base_overrides, tmp_path, monkeypatch
):
    cluster, other = two_nodes
    overrides = [
        *base_overrides,
        f"algorithm.num_steps={NUM_STEPS}",
        "algorithm.global_batch_size=16",
        "checkpoint.save_interval=1",
        "checkpoint.async_save=false",
    ]
    real_step = loop.run_step

    def step_losing_a_node(pair, task, step, **kwargs):
        if step == LOST_AT:
            cluster.remove_node(other)
        return real_step(pair, task, step, **kwargs)

    monkeypatch.setattr(loop, "run_step", step_losing_a_node)
    run_dir = tmp_path / "run"
    with pytest.raises(PlacementError) as lost:
        run(overrides, run_dir)
    message = str(lost.value)
    assert "lost with slots" in message and "resume=<run dir>" in message
    # the lost node held the trainer's bundle (slot 0) or the engine's (slot 1), and the message says which
    assert "(trainer ranks 0, engines none)" in message or "(trainer ranks none, engines 0)" in message
    assert all(info["state"] == "REMOVED" for info in ray.util.placement_group_table().values())

    monkeypatch.setattr(loop, "run_step", real_step)
    cluster.add_node(num_cpus=1)
    result = run(overrides, run_dir, resume=True)
    assert result.start_step == LOST_AT and result.weight_version == NUM_STEPS
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(NUM_STEPS))
