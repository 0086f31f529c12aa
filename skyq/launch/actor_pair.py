"""The trainer actor, the engine actor and the sync group between them, driven from the driver.

Nothing the driver waits for waits forever (`skyq.launch.deadlines`): a sync's own waits are bounded
by `rollout.weight_sync.timeout_s` inside the actors, and every call into an actor (start-up,
generate, train_step, a checkpoint, a whole sync) by `rollout.weight_sync.worker_call_timeout_s`;
the error names the actor, the call and the deadline. Secret worker environment variables reach
the actors through an owner-only file, never through Ray's logged `runtime_env`
(`skyq.launch.worker_env`).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import ray

from skyq.config.resolve import agree
from skyq.launch.actors import EngineWorker, TrainerWorker
from skyq.launch.deadlines import call_with_deadline, finished_with_deadline
from skyq.launch.pair import PairSpec, WorkerPair, describe_error
from skyq.launch.ray_local import startup_line
from skyq.launch.redaction import split_worker_env
from skyq.launch.worker_env import apply_env_file, remove_env_file, write_env_file
from skyq.sync.errors import SyncError

SYNC_PEER_GRACE_S = 10.0
"""Once one side of a sync has failed, how long the driver waits for the other side's own story
(both wait on the same transfers under the same deadline, so it fails at about the same moment)."""


class _TrainerActor(TrainerWorker):
    """`TrainerWorker` that first sets its secret environment variables from `env_file`."""

    def __init__(self, *, env_file: str | None, **kwargs: Any) -> None:
        apply_env_file(env_file)
        super().__init__(**kwargs)


class _EngineActor(EngineWorker):
    """`EngineWorker` that first sets its secret environment variables from `env_file`."""

    def __init__(self, *, env_file: str | None, **kwargs: Any) -> None:
        apply_env_file(env_file)
        super().__init__(**kwargs)


TrainerActor = ray.remote(_TrainerActor)
EngineActor = ray.remote(_EngineActor)


def _actor_options(num_gpus: float, public_env: dict[str, str]) -> dict[str, Any]:
    """Ray options of one actor; `public_env` holds only allow-listed (non-secret) variables."""
    options: dict[str, Any] = {"num_cpus": 1, "num_gpus": num_gpus, "max_restarts": 0}
    if public_env:
        options["runtime_env"] = {"env_vars": dict(public_env)}
    return options


class ActorPair(WorkerPair):
    """Builds both Ray actors and their sync group; `shutdown` ends them."""

    def __init__(self, spec: PairSpec) -> None:
        placement = spec.placement
        self.sync_cfg = spec.rollout.weight_sync
        self.call_timeout_s = self.sync_cfg.worker_call_timeout_s
        self.trainer = self.engine = None
        trainer_public, trainer_secret = split_worker_env(dict(spec.trainer.env))
        engine_public, engine_secret = split_worker_env(dict(spec.rollout.env))
        env_files: list[Path | None] = []
        try:
            env_files += [write_env_file(trainer_secret, "trainer"), write_env_file(engine_secret, "engine")]
            startup_line("starting the trainer and engine actors (model build, engine boot)")
            start = time.perf_counter()
            self.trainer = TrainerActor.options(
                **_actor_options(placement.trainer_gpus, trainer_public)
            ).remote(env_file=_str(env_files[0]), **spec.trainer_kwargs())
            self.engine = EngineActor.options(**_actor_options(placement.engine_gpus, engine_public)).remote(
                env_file=_str(env_files[1]), **spec.engine_kwargs()
            )
            # Hardware-dependent settings are resolved where the hardware is, then must agree.
            ready = {"trainer actor": self.trainer.report_resolution.remote(),
                     "engine actor": self.engine.report_resolution.remote()}  # fmt: skip
            resolutions = {}
            for worker, ref in finished_with_deadline(ready, "start-up", self.call_timeout_s):
                resolutions[worker] = ray.get(ref)
                side = worker.split()[0]
                built = self._call(side, "build_seconds")
                what = "model build" if side == "trainer" else "engine boot"
                startup_line(
                    f"{worker} ready after {time.perf_counter() - start:.1f} s ({what} {built:.1f} s)"
                )
            self.resolution = agree([resolutions["trainer actor"], resolutions["engine actor"]])
            start = time.perf_counter()
            timeout_s = self.sync_cfg.timeout_s
            port = self._call("trainer", "open_sync_store", timeout_s)
            joins = {"trainer actor": self.trainer.join_sync_group.remote(placement.sync_device),
                     "engine actor": self.engine.join_sync_group.remote(port, timeout_s, placement.sync_device)}  # fmt: skip
            for _, ref in finished_with_deadline(joins, "join_sync_group", self.call_timeout_s):
                ray.get(ref)
            startup_line(f"weight-sync group formed in {time.perf_counter() - start:.1f} s")
        except BaseException:
            self.shutdown()
            raise
        finally:
            for path in env_files:  # the actors deleted theirs on start; a failed start leaves nothing either
                remove_env_file(path)

    def sync(self, version: int) -> dict[str, float]:
        """One full weight sync as `version`; raises `SyncError` (with both sides' story) on failure,
        `WorkerTimeout` if the sync as a whole outlasts rollout.weight_sync.worker_call_timeout_s."""
        receiving = self.engine.receive_weights.remote(self.sync_cfg.verify_checksum)
        sending = self.trainer.send_weights.remote(version, self.sync_cfg.bucket_bytes)
        calls = {"trainer actor": sending, "engine actor": receiving}
        results: dict[str, Any] = {}
        for worker, ref in finished_with_deadline(
            calls, f"weight sync of version {version}", self.call_timeout_s
        ):
            try:
                results[worker] = ray.get(ref)
            except (SyncError, ray.exceptions.RayError) as exc:
                # The other side's story, if it has not finished yet, for at most SYNC_PEER_GRACE_S.
                story = {worker: _describe(exc)}
                for other, other_ref in calls.items():
                    if other != worker:
                        story[other] = (
                            "completed its side"
                            if other in results
                            else _outcome(other_ref, SYNC_PEER_GRACE_S)
                        )
                raise SyncError(
                    f"weight sync of version {version} failed. trainer: {story['trainer actor']}. "
                    f"engine: {story['engine actor']}"
                ) from exc
        engine_stats, metrics = results["engine actor"], results["trainer actor"]
        if engine_stats["version"] != version:
            raise SyncError(f"engine committed version {engine_stats['version']}, the trainer sent {version}")
        return metrics

    def _call(self, side: str, method: str, *args: Any, **kwargs: Any) -> Any:
        actor = self.trainer if side == "trainer" else self.engine
        ref = getattr(actor, method).remote(*args, **kwargs)
        return call_with_deadline(f"{side} actor", method, ref, self.call_timeout_s)

    def _describe_worker_error(self, exc: BaseException) -> str:
        return _describe(exc)

    def shutdown(self) -> None:
        for actor in (self.trainer, self.engine):
            if actor is not None:
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
