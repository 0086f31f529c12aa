"""Compose real configs and call the real driver the way `skyq.train` does."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from skyq.config.schema import TrainConfig
from skyq.config.store import compose, to_object
from skyq.launch.loop import RunResult, run_rl

# Pinned here so the tests do not move with the defaults: a task the tiny model learns visibly
# within 24 steps (copy after a short warm-up) at a batch small enough for a 2-core CI box.
TEST_OVERRIDES = [
    "task.arith_op=copy",
    "model.init_sft_steps=10",
    "algorithm.lr=0.003",
    "algorithm.global_batch_size=64",
    "trainer.micro_batch_size=16",
    "logger.progress_bar=false",
]


def compose_config(overrides: list[str]) -> tuple[TrainConfig, dict[str, Any]]:
    cfg = compose(overrides)
    return to_object(cfg), OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)


def run(overrides: list[str], run_dir: Path, *, resume: bool = False) -> RunResult:
    cfg, container = compose_config(overrides)
    return run_rl(
        model=cfg.model,
        precision=cfg.precision,
        algorithm=cfg.algorithm,
        task=cfg.task,
        rollout=cfg.rollout,
        trainer=cfg.trainer,
        topology=cfg.topology,
        logger=cfg.logger,
        checkpoint=cfg.checkpoint,
        seed=cfg.seed,
        config_container=container,
        run_dir=run_dir,
        resume=resume,
    )


@contextmanager
def two_ray_nodes(num_gpus: int = 0) -> Iterator[tuple[Any, Any]]:
    """A Ray cluster of two nodes on this machine (`ray.cluster_utils.Cluster`, loopback, one CPU
    and `num_gpus` logical GPUs each), this process its driver; yields (cluster, the non-head node)."""
    import ray
    from ray.cluster_utils import Cluster

    from skyq.launch.ray_local import _loopback_node

    assert not ray.is_initialized(), "another test module left Ray running"
    node = {"num_cpus": 1, "num_gpus": num_gpus}
    with _loopback_node():
        cluster = Cluster(initialize_head=True, head_node_args={**node, "include_dashboard": False})
        other = cluster.add_node(**node)
        ray.init(address=cluster.address, log_to_driver=False)
    try:
        yield cluster, other
    finally:
        ray.shutdown()
        cluster.shutdown()
