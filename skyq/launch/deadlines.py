"""Deadlines on the driver's calls into its workers: nothing the run loop waits for waits forever.

`call_with_deadline` waits for one remote call (a Ray `ObjectRef`) at most `deadline_s` seconds;
past that it raises `WorkerTimeout` naming the worker, the call, the deadline and the config key
that sets it, and the run stops (its workers are killed on the way out) instead of hanging with
no output. Any driver that calls into remote workers uses it, whatever the worker kind.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import ray

CALL_TIMEOUT_KEY = "rollout.weight_sync.worker_call_timeout_s"
"""The config key of the deadline of every driver -> worker call other than the sync's own waits."""


class WorkerTimeout(TimeoutError):
    """A worker did not answer a call within its deadline."""

    def __init__(self, worker: str, call: str, deadline_s: float, key: str) -> None:
        self.worker, self.call, self.deadline_s = worker, call, deadline_s
        super().__init__(
            f"{worker}: {call} did not return within {deadline_s:g} s ({key}); the worker is stuck "
            f"or far slower than this deadline allows. The run stops instead of waiting forever; raise "
            f"{key} if the call legitimately takes this long"
        )


def call_with_deadline(
    worker: str, call: str, ref: ray.ObjectRef, deadline_s: float, key: str = CALL_TIMEOUT_KEY
) -> Any:
    """The result of the remote call `ref` (`worker`'s method `call`), waited for at most `deadline_s`.

    The worker's own exception is raised as Ray raises it (`RayTaskError` wrapping it); a call with
    no answer by the deadline raises `WorkerTimeout`. The call is not cancelled: the caller ends
    the worker (its state is unknown)."""
    try:
        return ray.get(ref, timeout=deadline_s)
    except ray.exceptions.GetTimeoutError:
        raise WorkerTimeout(worker, call, deadline_s, key) from None


def finished_with_deadline(
    calls: dict[str, ray.ObjectRef], call: str, deadline_s: float, key: str = CALL_TIMEOUT_KEY
) -> Iterator[tuple[str, ray.ObjectRef]]:
    """(worker, ref) of each of `calls` ({worker: ref}) as it finishes (the caller `ray.get`s it),
    all within one deadline `deadline_s` from now; `WorkerTimeout` names the workers still silent
    at the deadline."""
    pending = {ref: worker for worker, ref in calls.items()}
    end = time.monotonic() + deadline_s
    while pending:
        ready, _ = ray.wait(list(pending), num_returns=1, timeout=max(0.0, end - time.monotonic()))
        if not ready:
            raise WorkerTimeout(" and ".join(pending.values()), call, deadline_s, key)
        yield pending.pop(ready[0]), ready[0]
