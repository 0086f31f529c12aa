"""`LocalPair`: the trainer and the engine in the driver process, sharing one device.

The colocated one-GPU layout (`topology=1gpu`): no Ray, no second process, no host staging. A sync
runs the engine's receive on a helper thread while the trainer sends on the calling thread, frames
passing through an in-process channel as device-to-device copies, with the same manifest,
checksums, deadlines and all-or-nothing commit as between Ray actors. Worker env vars
(`trainer.env`, `rollout.env`) are set in this process for the pair's lifetime; the two must not
give one variable different values, since there is only one process to hold them.
"""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from skyq.config.resolve import agree
from skyq.launch.actors import EngineWorker, TrainerWorker
from skyq.launch.deadlines import CALL_TIMEOUT_KEY, WorkerTimeout
from skyq.launch.pair import PairSpec, WorkerPair, describe_error
from skyq.launch.redaction import is_public_env_name
from skyq.sync.errors import SyncError
from skyq.sync.in_process import in_process_pair


def merged_worker_env(trainer_env: dict[str, str], rollout_env: dict[str, str]) -> dict[str, str]:
    """The variables both workers need in their one shared process; refuses a conflicting pair."""
    clashes = sorted(k for k in trainer_env.keys() & rollout_env.keys() if trainer_env[k] != rollout_env[k])
    if clashes:
        key = clashes[0]
        # A worker env value is a secret unless allow-listed: an error message must not print it.
        shown = (f"={trainer_env[key]!r}", f"={rollout_env[key]!r}") if is_public_env_name(key) else ("", "")
        raise ValueError(
            f"trainer.env.{key}{shown[0]} but rollout.env.{key}{shown[1]} differ: with the "
            "trainer and the engine in one process (one GPU, in_process transport) a variable has one value. "
            "Give both the same value, or use a topology with a GPU per worker."
        )
    return {**trainer_env, **rollout_env}


class LocalPair(WorkerPair):
    """Both workers built in this process; `shutdown` closes the channel and restores the env."""

    def __init__(self, spec: PairSpec) -> None:
        if not spec.placement.in_process:
            raise ValueError(f"LocalPair needs an in_process placement, got {spec.placement.transport.value}")
        self.sync_cfg = spec.rollout.weight_sync
        env = merged_worker_env(dict(spec.trainer.env), dict(spec.rollout.env))
        self._saved_env = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        self.trainer: TrainerWorker | None = None
        self.engine: EngineWorker | None = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="skyq-engine-recv")
        self._calls = ThreadPoolExecutor(max_workers=1, thread_name_prefix="skyq-worker-call")
        """Every other worker call runs on this one thread, waited for with the call deadline: a hung
        call cannot be interrupted in-process, but the run stops at its deadline instead of waiting."""
        self.call_timeout_s = self.sync_cfg.worker_call_timeout_s
        try:
            backends = spec.backends()
            if spec.num_engines != 1 or not backends.in_process:
                raise ValueError(
                    f"rollout.num_engines={spec.num_engines}, rollout={spec.rollout.backend.value}: the one-GPU "
                    "in-process layout holds one trainer and one embedded engine in the driver process; use "
                    "rollout.weight_sync.transport=broadcast (Ray actors) for this rollout group"
                )
            self.trainer = backends.trainer_class()(**spec.trainer_kwargs())
            self.engine = backends.engine_class()(**spec.engine_kwargs(0))
            self.resolution = agree([self.trainer.report_resolution(), self.engine.report_resolution()])
            sender_end, receiver_end = in_process_pair(self.sync_cfg.timeout_s)
            self.trainer.use_channel(sender_end)
            self.engine.use_channel(receiver_end)
        except BaseException:
            self.shutdown()
            raise

    def _call(self, side: str, method: str, *args: Any, **kwargs: Any) -> Any:
        worker = self.trainer if side == "trainer" else self.engine
        future = self._calls.submit(getattr(worker, method), *args, **kwargs)
        try:
            return future.result(timeout=self.call_timeout_s)
        except FutureTimeout:
            raise WorkerTimeout(
                f"{side} (in this process)", method, self.call_timeout_s, CALL_TIMEOUT_KEY
            ) from None

    def sync(self, version: int) -> dict[str, float]:
        assert self.trainer is not None and self.engine is not None
        receiving = self._pool.submit(self.engine.receive_weights, self.sync_cfg.verify_checksum)
        try:
            metrics = self.trainer.send_weights(version, self.sync_cfg.bucket_bytes)
        except Exception as exc:
            if not receiving.done():  # the engine would otherwise wait out rollout.weight_sync.timeout_s
                self.trainer.abort_sync(describe_error(exc))
            raise SyncError(
                f"weight sync of version {version} failed. trainer: {describe_error(exc)}. "
                f"engine: {_outcome(receiving, self.sync_cfg.timeout_s + 30)}"
            ) from exc
        try:
            engine_stats = receiving.result(timeout=self.sync_cfg.timeout_s + 30)
        except FutureTimeout:
            raise SyncError(
                f"weight sync of version {version}: the engine did not finish receiving"
            ) from None
        if engine_stats["version"] != version:
            raise SyncError(f"engine committed version {engine_stats['version']}, the trainer sent {version}")
        return metrics

    def shutdown(self) -> None:
        if self.trainer is not None:
            self.trainer.drop_save_state()  # no checkpoint writer outlives the pair
        for worker in (self.trainer, self.engine):
            if worker is not None:
                worker.close()
        self._pool.shutdown(wait=True)
        self._calls.shutdown(wait=False, cancel_futures=True)  # a call past its deadline is not waited for
        for key, value in self._saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        self._saved_env = {}


def _outcome(receiving: Future, timeout_s: float) -> str:
    try:
        receiving.result(timeout=timeout_s)
    except FutureTimeout:
        return f"no answer within {timeout_s:.0f} s"
    except Exception as exc:  # the engine's own failure, reported beside the trainer's
        return describe_error(exc)
    return "completed its side"
