"""Hydra callback of `python -m skyq.train -m ...`: one Ray session for the sweep, nothing leaked
between its jobs, and the sweep's comparison report at the end.

Hydra's basic launcher runs the jobs one after another in this process. Starting Ray costs seconds
per job, so the first job that needs Ray starts it (the loopback local cluster of a run, or the
logical cluster of `simulate=true`) and the next jobs reuse it: `local_ray` and `logical_cluster`
take a running Ray as is. A job that needs another kind of cluster (a simulation after a run, or a
bigger simulation) gets a fresh one. Where sharing is not safe the job starts its own Ray as a
single run does: dry runs need none, and a rollout=vllm job in an environment without vLLM
re-executes the process (a shared Ray would be orphaned).

At each job's end, failed or not, what the job left in the session is removed: placement groups
not removed yet (the job's own `probe.placement` removes its group in any case; this is the
backstop) and actors still alive are killed. If anything cannot be removed, the session is shut
down and the next job starts a fresh one. One line per job says what was found.
"""

from __future__ import annotations

import importlib.util
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig


def leftovers() -> tuple[list[str], list[str]]:
    """Ids of the placement groups not removed and the actors not dead in the running Ray session."""
    import ray
    from ray._private import state

    groups = [pg for pg, info in ray.util.placement_group_table().items() if info["state"] != "REMOVED"]
    actors = [a for a, info in state.state.actor_table(None).items() if info["State"] != "DEAD"]
    return groups, actors


def clean_up() -> tuple[int, int, bool]:
    """Remove leftover placement groups and kill leftover actors; (groups, actors, all gone)."""
    import ray
    from ray._raylet import ActorID, PlacementGroupID
    from ray.util.placement_group import PlacementGroup, remove_placement_group

    groups, actors = leftovers()
    for pg in groups:
        remove_placement_group(PlacementGroup(PlacementGroupID(bytes.fromhex(pg))))
    core = ray._private.worker.global_worker.core_worker
    for actor in actors:
        core.kill_actor(ActorID(bytes.fromhex(actor)), True)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(leftovers()):
        time.sleep(0.1)
    return len(groups), len(actors), not any(leftovers())


def session_kind(config: DictConfig) -> tuple[Any, ...] | None:
    """The Ray cluster job `config` needs, or None where the sweep must not share one."""
    if config.dry_run:
        return None
    if config.simulate:
        return ("logical", config.topology.num_nodes * config.topology.gpus_per_node)
    if config.rollout.backend == "vllm":
        spec = importlib.util.find_spec("vllm")
        if spec is None or spec.origin is None:  # the job re-executes itself under .venv-vllm
            return None
    return ("local",)


class SweepRaySession:
    """The sweep's Ray session: opened for the first job that needs one, kept while jobs agree."""

    def __init__(self) -> None:
        self.kind: tuple[Any, ...] | None = None
        self.started_for = -1
        self._stack = ExitStack()

    def before_job(self, config: DictConfig, job: int) -> None:
        need = session_kind(config)
        if need is None:
            self.close()
            return
        reusable = self.kind is not None and (
            self.kind == need or (self.kind[0] == need[0] == "logical" and self.kind[1] >= need[1])
        )
        if not reusable:
            self.close()
            if need[0] == "logical":
                from skyq.launch.simulate import logical_cluster

                self._stack.enter_context(logical_cluster(need[1]))
            else:
                from skyq.launch.ray_local import local_ray

                self._stack.enter_context(local_ray())
            self.kind, self.started_for = need, job
        import ray

        groups, actors = leftovers()
        print(
            f"sweep: job {job} runs in the sweep's Ray session {ray.get_runtime_context().gcs_address} "
            f"(started for job {self.started_for}; {len(groups)} placement group(s), {len(actors)} actor(s) alive)",
            flush=True,
        )

    def after_job(self, job: int) -> None:
        if self.kind is None:
            return
        groups, actors, clean = clean_up()
        kept = "kept for the next job" if clean else "shut down: something could not be removed"
        print(
            f"sweep: job {job} ended; removed {groups} placement group(s) and {actors} actor(s) it left; Ray session {kept}",
            flush=True,
        )
        if not clean:
            self.close()

    def close(self) -> None:
        self._stack.close()
        self._stack = ExitStack()
        self.kind = None


class SweepReportCallback(Callback):
    def __init__(self) -> None:
        self.session: SweepRaySession | None = None

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self.session = SweepRaySession()

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        if self.session is not None:
            self.session.before_job(config, config.hydra.job.num)

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        if self.session is not None:
            self.session.after_job(config.hydra.job.num)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        if self.session is not None:
            self.session.close()
        sweep_dir = Path(config.hydra.sweep.dir)
        if config.dry_run or config.simulate or not sweep_dir.is_dir():
            return
        from skyq.report import write_report

        table = write_report(sweep_dir)
        print(table)
