"""The trainer actor, the engine actor and the sync group between them, driven from the driver.

Nothing the driver waits for waits forever (`skyq.launch.deadlines`): a sync's own waits are bounded
by `rollout.weight_sync.timeout_s` inside the actors, and every call into an actor (start-up,
generate, train_step, a checkpoint, a whole sync) by `rollout.weight_sync.worker_call_timeout_s`;
the error names the actor, the call and the deadline. Secret worker environment variables reach
the actors through an owner-only file, never through Ray's logged `runtime_env`
(`skyq.launch.worker_env`).

Where the actors go is the placement plan's (`skyq.launch.plan`): the pair reserves the plan's one
placement group through the two-phase start (`skyq.launch.probe.placement`: reserve within
topology.placement_timeout_s, probe, re-sort, resolve on GPUs) and starts the trainer actor and
every engine actor with `actor_options` (bundle, GPU fraction or CPU share, the plan's env). The
trainer actor is handed the started placement too, so a trainer that starts ranks of its own (the
Megatron world) puts each on its planned bundle. `shutdown` removes the group, however the run
ended. When a call fails or outlasts its deadline, a node of the group that is gone is named
(`probe.check_intact`) instead of the bare failure.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import ray

from skyq.config.enums import Device
from skyq.config.resolve import agree
from skyq.config.schema import TopologyConfig
from skyq.launch.deadlines import WorkerTimeout, call_with_deadline, finished_with_deadline
from skyq.launch.pair import PairSpec, WorkerPair, describe_error, engine_names
from skyq.launch.plan import ENGINE, TRAINER, PlacementPlan, plan_placement
from skyq.launch.probe import PlacementError, StartedPlacement, check_intact, placement, set_actor_placement
from skyq.launch.ray_local import startup_line
from skyq.launch.worker_env import apply_env_file, remove_env_file, write_env_file
from skyq.sync.errors import SyncError

ACTOR_CLOSE_TIMEOUT_S = 10.0
"""How long an actor's `close` may take at shutdown before the actor is killed regardless."""

SYNC_PEER_GRACE_S = 10.0
"""Once one side of a sync has failed, how long the driver waits for the other side's own story
(both wait on the same transfers under the same deadline, so it fails at about the same moment)."""


def _worker_class(cls: type) -> type:
    """`cls` whose constructor first sets its secret environment variables from `env_file` and
    records the placement the actor was started from (`probe.actor_placement`)."""

    def __init__(self, *, env_file: str | None, placement: StartedPlacement, **kwargs: Any) -> None:
        apply_env_file(env_file)
        set_actor_placement(placement)
        cls.__init__(self, **kwargs)

    return type(cls.__name__, (cls,), {"__init__": __init__, "__module__": cls.__module__})


def pair_plan(spec: PairSpec) -> PlacementPlan:
    """The placement plan of a CPU pair built from `spec` alone (its topology is the CPU's, with
    `spec.parallel`); a GPU pair takes the plan of its topology (`ActorPair(spec, plan)`)."""
    if Device(spec.placement.device) is not Device.cpu:
        raise ValueError(
            "a GPU pair needs the placement plan of its topology: ActorPair(spec, plan_placement(topology=...))"
        )
    topology = TopologyConfig(parallel=spec.parallel)
    return plan_placement(topology=topology, rollout=spec.rollout, trainer=spec.trainer)


class ActorPair(WorkerPair):
    """Reserves the plan's placement group, then builds the trainer actor, the rollout group's
    engine actors (the plan's engines, each its own sync group with the trainer) and their sync
    groups on it; `shutdown` ends them and removes the group."""

    def __init__(
        self,
        spec: PairSpec,
        plan: PlacementPlan | None = None,
        *,
        placement_timeout_s: float = TopologyConfig.placement_timeout_s,
    ) -> None:
        """`plan`: `plan_placement` of the run's topology (None: `pair_plan(spec)`, a CPU pair).
        `placement_timeout_s`: topology.placement_timeout_s, the deadline of the reservation."""
        placement_cfg = spec.placement
        backends = spec.backends()
        plan = pair_plan(spec) if plan is None else plan
        self.sync_cfg = spec.rollout.weight_sync
        self.call_timeout_s = self.sync_cfg.worker_call_timeout_s
        self.trainer = None
        self.engines: list[Any] = []
        self.num_engines = len(plan.engines)
        self.engine_names = engine_names(self.num_engines)
        self.started: StartedPlacement | None = None
        self._placement = ExitStack()
        env_files: list[Path | None] = []
        try:
            start = time.perf_counter()
            self.started = self._placement.enter_context(
                placement(plan, spec.precision, timeout_s=placement_timeout_s)
            )
            started = self.started
            startup_line(
                f"placement group of {len(plan.bundles)} bundle(s) ready in {time.perf_counter() - start:.1f} s"
            )
            env_files.append(write_env_file(started.plan.secret_env(TRAINER, 0), "trainer"))
            env_files += [
                write_env_file(started.plan.secret_env(ENGINE, i), "engine") for i in range(self.num_engines)
            ]
            startup_line("starting the trainer and engine actors (model build, engine boot)")
            start = time.perf_counter()
            trainer_actor = ray.remote(_worker_class(backends.trainer_class()))
            engine_actor = ray.remote(_worker_class(backends.engine_class()))
            self.trainer = trainer_actor.options(**_options(started, TRAINER, 0)).remote(
                env_file=_str(env_files[0]), placement=started, **spec.trainer_kwargs()
            )
            for i, env_file in enumerate(env_files[1:]):
                self.engines.append(
                    engine_actor.options(**_options(started, ENGINE, i)).remote(
                        env_file=_str(env_file), placement=started, **spec.engine_kwargs(i)
                    )
                )
            # Hardware-dependent settings are resolved where the hardware is, then must agree.
            ready = {"trainer actor": self.trainer.report_resolution.remote()}
            ready.update(
                {name: e.report_resolution.remote() for name, e in zip(self.engine_names, self.engines)}
            )
            resolutions = {}
            for worker, ref in finished_with_deadline(ready, "start-up", self.call_timeout_s):
                resolutions[worker] = ray.get(ref)
                built = call_with_deadline(
                    worker, "build_seconds", self._actor(worker).build_seconds.remote(), self.call_timeout_s
                )
                what = "model build" if worker == "trainer actor" else "engine boot"
                startup_line(
                    f"{worker} ready after {time.perf_counter() - start:.1f} s ({what} {built:.1f} s)"
                )
            self.resolution = agree([resolutions[w] for w in ready])
            start = time.perf_counter()
            timeout_s = self.sync_cfg.timeout_s
            ports = [self._call("trainer", "open_sync_store", timeout_s) for _ in self.engines]
            joins = {"trainer actor": self.trainer.join_sync_group.remote(placement_cfg.sync_device)}
            joins.update(
                {
                    name: e.join_sync_group.remote(port, timeout_s, placement_cfg.sync_device)
                    for name, e, port in zip(self.engine_names, self.engines, ports)
                }
            )
            for _, ref in finished_with_deadline(joins, "join_sync_group", self.call_timeout_s):
                ray.get(ref)
            startup_line(f"weight-sync group formed in {time.perf_counter() - start:.1f} s")
        except BaseException as exc:
            lost = self._lost_node(exc)  # before shutdown removes the group
            self.shutdown()
            if lost is not None:
                raise lost from exc
            raise
        finally:
            for path in env_files:  # the actors deleted theirs on start; a failed start leaves nothing either
                remove_env_file(path)

    @property
    def engine(self) -> Any:
        """The first engine actor (the only one unless rollout.num_engines > 1)."""
        return self.engines[0]

    def _actor(self, worker: str) -> Any:
        return self.trainer if worker == "trainer actor" else self.engines[self.engine_names.index(worker)]

    def _lost_node(self, exc: BaseException) -> PlacementError | None:
        """For a failed or timed-out call (`exc`): the error naming a node of the placement group
        that is gone, if one is (`probe.check_intact`); None when the group is whole."""
        if self.started is None or not isinstance(exc, (WorkerTimeout, SyncError, ray.exceptions.RayError)):
            return None
        try:
            check_intact(self.started)
        except PlacementError as lost:
            return lost
        return None

    @contextmanager
    def _naming_lost_node(self) -> Iterator[None]:
        """Re-raise a failed call as the lost node's `PlacementError` when a node is gone."""
        try:
            yield
        except (WorkerTimeout, SyncError, ray.exceptions.RayError) as exc:
            lost = self._lost_node(exc)
            if lost is None:
                raise
            raise lost from exc

    def sync(self, version: int) -> dict[str, float]:
        """One full weight sync as `version` to every engine (`_sync`); a failure with a node of the
        placement group gone raises `PlacementError` naming it."""
        with self._naming_lost_node():
            return self._sync(version)

    def _sync(self, version: int) -> dict[str, float]:
        """One full weight sync as `version` to every engine; raises `SyncError` (with every side's
        story) on failure, `WorkerTimeout` if the sync as a whole outlasts
        rollout.weight_sync.worker_call_timeout_s. The run's version advances only when every
        engine has verified and committed it.

        The trainer sends to the engines in turn and each commits on receipt; there is no
        stage-then-commit across engines. So when engine i fails, the engines before it already hold
        `version`, which the run never reached. That is safe because a failed sync stops the run:
        nothing is sampled after it, no metrics row or checkpoint records `version`, and every engine
        is shut down with the run. Resume boots fresh engines, and the session's first sync brings them
        the checkpoint's weights, compared bit for bit on every engine before any rollout. Staging
        would hold each engine's verified copy until all had verified and still could not make the
        commits atomic (a layerwise load can fail part-way on one engine after the others loaded)."""
        calls = {name: e.receive_weights.remote(self.sync_cfg.verify_checksum) for name, e in zip(self.engine_names, self.engines)}  # fmt: skip
        calls["trainer actor"] = self.trainer.send_weights.remote(version, self.sync_cfg.bucket_bytes)
        results: dict[str, Any] = {}
        for worker, ref in finished_with_deadline(
            calls, f"weight sync of version {version}", self.call_timeout_s
        ):
            try:
                results[worker] = ray.get(ref)
            except (SyncError, ray.exceptions.RayError) as exc:
                # The other sides' story, if they have not finished yet, for at most SYNC_PEER_GRACE_S.
                story = {worker: _describe(exc)}
                for other, other_ref in calls.items():
                    if other != worker:
                        story[other] = (
                            "completed its side"
                            if other in results
                            else _outcome(other_ref, SYNC_PEER_GRACE_S)
                        )
                sides = ". ".join(f"{w.removesuffix(' actor')}: {story[w]}" for w in ["trainer actor", *self.engine_names])  # fmt: skip
                raise SyncError(f"weight sync of version {version} failed. {sides}") from exc
        for name in self.engine_names:
            if results[name]["version"] != version:
                raise SyncError(
                    f"{name} committed version {results[name]['version']}, the trainer sent {version}"
                )
        return results["trainer actor"]

    def _call(self, side: str, method: str, *args: Any, **kwargs: Any) -> Any:
        worker = "trainer actor" if side == "trainer" else self.engine_names[0]
        with self._naming_lost_node():
            ref = getattr(self._actor(worker), method).remote(*args, **kwargs)
            return call_with_deadline(worker, method, ref, self.call_timeout_s)

    def _call_engines(self, method: str, calls: list[tuple[tuple, dict]]) -> list[Any]:
        refs = {
            name: getattr(e, method).remote(*args, **kwargs)
            for name, e, (args, kwargs) in zip(self.engine_names, self.engines, calls)
        }
        results = {}
        with self._naming_lost_node():
            for worker, ref in finished_with_deadline(refs, method, self.call_timeout_s):
                results[worker] = ray.get(ref)
        return [results[name] for name in self.engine_names]

    def _describe_worker_error(self, exc: BaseException) -> str:
        return _describe(exc)

    def shutdown(self) -> None:
        """Stop every actor, then remove the placement group (idempotent)."""
        for actor in (self.trainer, *self.engines):
            if actor is not None:
                _stop(actor)
        self.trainer, self.engines = None, []
        self._placement.close()


def _options(started: StartedPlacement, role: str, index: int) -> dict[str, Any]:
    """The plan's Ray options of one worker actor, never restarted (a restarted actor would have
    lost its model and its place in the sync group)."""
    return {**started.actor_options(role, index), "max_restarts": 0}


def _stop(actor: Any) -> None:
    """End `actor`: its `close` first (an engine shuts down the processes it started; bounded), then kill."""
    try:
        ray.get(actor.close.remote(), timeout=ACTOR_CLOSE_TIMEOUT_S)
    except Exception:  # a dead or stuck actor is killed all the same
        pass
    ray.kill(actor)


def _str(path: Path | None) -> str | None:
    return None if path is None else str(path)


def _describe(exc: BaseException) -> str:
    """One line for an error raised inside an actor (its original exception) or by Ray itself."""
    if isinstance(exc, ray.exceptions.RayTaskError) and exc.cause is not None:
        exc = exc.cause
    return describe_error(exc)


def _outcome(ref: ray.ObjectRef, timeout_s: float) -> str:
    try:
        ray.get(ref, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        return f"no answer within {timeout_s:.0f} s"
    except (SyncError, ray.exceptions.RayError) as exc:
        return _describe(exc)
    return "completed its side"
