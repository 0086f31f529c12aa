"""Run guards: stop a run loudly when its metrics say the engine is not sampling the trainer's policy.

The dangerous failures of low-precision RL raise nothing (an engine that accepts every weight push and
applies none, scales read with the wrong convention, a cache that silently drops context); they show
up as a train/rollout mismatch that stays high. `MismatchGuard` watches the per-step mismatch (mean
|logp_trainer - logp_rollout| per response token, the trainer's own measurement) and ends the run once
it has exceeded `algorithm.max_mismatch` for `algorithm.mismatch_patience` consecutive steps: a
healthy run sits one to three orders of magnitude below the default limit (docs/benchmarks.md).
"""

from __future__ import annotations

import math


class MismatchError(RuntimeError):
    """The train/rollout mismatch stayed over its limit: the run stopped instead of training on it."""


class MismatchGuard:
    """Counts consecutive steps over the limit; `observe` raises `MismatchError` at `patience`."""

    def __init__(self, limit: float, patience: int) -> None:
        if limit < 0 or patience < 1:
            raise ValueError(
                f"algorithm.max_mismatch={limit} must be >= 0 (0 = off) and "
                f"algorithm.mismatch_patience={patience} >= 1"
            )
        self.limit, self.patience = limit, patience
        self._over: list[tuple[int, float]] = []

    def observe(self, step: int, mismatch: float) -> None:
        """Record one step's mean |dlogp|; a non-finite value counts as over the limit."""
        if self.limit == 0:
            return
        if math.isfinite(mismatch) and mismatch <= self.limit:
            self._over.clear()
            return
        self._over.append((step, mismatch))
        if len(self._over) < self.patience:
            return
        steps = ", ".join(f"step {s}: {v:.4g}" for s, v in self._over)
        raise MismatchError(
            f"train/rollout mismatch (mean |logp_trainer - logp_rollout| per token) above "
            f"algorithm.max_mismatch={self.limit:g} for {len(self._over)} consecutive steps ({steps}). "
            "The engine is not sampling the policy the trainer holds, so the updates are off-policy noise: "
            "check the weight sync (sync/* metrics, was every push applied?), that trainer and engine agree "
            "on the precision recipe, and the engine's decode path. The metrics up to this step are in the "
            "run's metrics.jsonl. If the mismatch is expected, raise algorithm.max_mismatch (0 turns the guard off)."
        )
