"""The trainer actor, the engine actor and the sync group between them, driven from the driver.

Every call into an actor that belongs to a sync has a deadline; the sync's own waits are bounded
by `rollout.weight_sync.timeout_s` inside the actors, and the driver adds a backstop on top.
"""

from __future__ import annotations

from typing import Any

import ray

from skyq.config.resolve import agree
from skyq.launch.actors import EngineWorker, TrainerWorker
from skyq.launch.pair import PairSpec, WorkerPair, describe_error
from skyq.sync.errors import SyncError

ACTOR_START_TIMEOUT_S = 600.0
"""Backstop for building an actor (imports, model load): a wedged worker fails the run."""

TrainerActor = ray.remote(TrainerWorker)
EngineActor = ray.remote(EngineWorker)


def _actor_options(num_gpus: float, env: dict[str, str]) -> dict[str, Any]:
    options: dict[str, Any] = {"num_cpus": 1, "num_gpus": num_gpus, "max_restarts": 0}
    if env:
        options["runtime_env"] = {"env_vars": dict(env)}
    return options


class ActorPair(WorkerPair):
    """Builds both Ray actors and their sync group; `shutdown` ends them."""

    def __init__(self, spec: PairSpec) -> None:
        placement = spec.placement
        self.sync_cfg = spec.rollout.weight_sync
        self.trainer = TrainerActor.options(
            **_actor_options(placement.trainer_gpus, spec.trainer.env)
        ).remote(**spec.trainer_kwargs())
        self.engine = EngineActor.options(**_actor_options(placement.engine_gpus, spec.rollout.env)).remote(
            **spec.engine_kwargs()
        )
        timeout_s = self.sync_cfg.timeout_s
        try:
            # Hardware-dependent settings are resolved where the hardware is, then must agree.
            self.resolution = agree(
                ray.get(
                    [self.trainer.report_resolution.remote(), self.engine.report_resolution.remote()],
                    timeout=ACTOR_START_TIMEOUT_S,
                )
            )
            port = ray.get(self.trainer.open_sync_store.remote(timeout_s), timeout=ACTOR_START_TIMEOUT_S)
            ray.get(
                [
                    self.trainer.join_sync_group.remote(placement.sync_device),
                    self.engine.join_sync_group.remote(port, timeout_s, placement.sync_device),
                ],
                timeout=ACTOR_START_TIMEOUT_S,
            )
        except BaseException:
            self.shutdown()
            raise

    def sync(self, version: int) -> dict[str, float]:
        """One full weight sync as `version`; raises `SyncError` (with both sides' story) on failure."""
        backstop = 4 * self.sync_cfg.timeout_s + 60
        receiving = self.engine.receive_weights.remote(self.sync_cfg.verify_checksum)
        sending = self.trainer.send_weights.remote(version, self.sync_cfg.bucket_bytes)
        try:
            metrics = ray.get(sending, timeout=backstop)
        except (SyncError, ray.exceptions.RayError) as exc:
            raise SyncError(
                f"weight sync of version {version} failed. trainer: {_describe(exc)}. "
                f"engine: {_outcome(receiving, self.sync_cfg.timeout_s + 30)}"
            ) from exc
        engine_stats = ray.get(receiving, timeout=self.sync_cfg.timeout_s + 30)
        if engine_stats["version"] != version:
            raise SyncError(f"engine committed version {engine_stats['version']}, the trainer sent {version}")
        return metrics

    def _call(self, side: str, method: str, *args: Any, **kwargs: Any) -> Any:
        actor = self.trainer if side == "trainer" else self.engine
        return ray.get(getattr(actor, method).remote(*args, **kwargs))

    def _describe_worker_error(self, exc: BaseException) -> str:
        return _describe(exc)

    def shutdown(self) -> None:
        for actor in (self.trainer, self.engine):
            ray.kill(actor)


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
