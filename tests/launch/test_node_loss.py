"""A node lost mid-run: two Ray nodes on this machine (`ray.cluster_utils.Cluster`, one logical GPU
each), the 2-GPU split plan across them (trainer on one, engine on the other), stand-in workers
started from the plan's options; the engine's node is removed. Its worker fails at once, and
`check_intact` names the node, the slot and the engine within a deadline. (`resume=` after such
a stop is the checkpoint resume tested in test_checkpointing / test_embedded_run.)"""

from __future__ import annotations

import time

import pytest
import ray

from skyq.config.store import compose, to_object
from skyq.launch.plan import ENGINE, TRAINER, plan_placement
from skyq.launch.probe import PlacementError, ProbeReport, check_intact, placement

from .run_helpers import two_ray_nodes

DETECT_WITHIN_S = 30.0


@pytest.fixture(scope="module")
def two_nodes():
    with two_ray_nodes(num_gpus=1) as nodes:
        yield nodes


def test_a_lost_node_stops_the_run_naming_the_node_and_its_workers(two_nodes):
    cluster, other = two_nodes

    def report(bundle: int, head_node: str) -> ProbeReport:
        """Both raylets share 127.0.0.1: a simulated IP tells the head node from the other. (Defined
        here, like `Worker`, so Ray ships it by value: the workers cannot import the tests.)"""
        head = ray.get_runtime_context().get_node_id() == head_node
        return ProbeReport(bundle, "10.0.0.1" if head else "10.0.0.2", "h", 0, (9, 0))

    @ray.remote(num_cpus=0)
    class Worker:
        def node(self) -> str:
            return ray.get_runtime_context().get_node_id()

        def work(self, seconds: float) -> int:
            time.sleep(seconds)
            return 1

    cfg = to_object(
        compose(["recipe=small_moe_fp8_blockwise_2gpu", "topology.num_nodes=2", "topology.gpus_per_node=1"])
    )
    plan = plan_placement(topology=cfg.topology, rollout=cfg.rollout, trainer=cfg.trainer)
    head = ray.get_runtime_context().get_node_id()
    with placement(plan, cfg.precision, timeout_s=60, report=report, report_args=(head,)) as started:
        trainer = Worker.options(**started.actor_options(TRAINER, 0)).remote()
        engine = Worker.options(**started.actor_options(ENGINE, 0)).remote()
        assert (
            ray.get(engine.node.remote(), timeout=60)
            == other.node_id
            != ray.get(trainer.node.remote(), timeout=60)
        )
        check_intact(started)  # whole: nothing raised
        call = engine.work.remote(60)
        cluster.remove_node(other)
        start = time.monotonic()
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(call, timeout=DETECT_WITHIN_S)
        while True:
            try:
                check_intact(started)
            except PlacementError as exc:
                message = str(exc)
                break
            assert time.monotonic() - start < DETECT_WITHIN_S, "the lost node was not noticed"
            time.sleep(0.2)
        assert "node(s) 10.0.0.2 lost with slots 1 (trainer ranks none, engines 0)" in message
        assert "resume=<run dir>" in message
        assert ray.get(trainer.work.remote(0), timeout=30) == 1  # the other node's worker is untouched
