"""Errors of the weight sync. After any of them the engine keeps its previous weights and version."""

from __future__ import annotations


class SyncError(RuntimeError):
    """A weight sync did not complete; the engine still serves the weights it had before."""


class SyncRefused(SyncError, ValueError):
    """A sync was refused because what was sent does not match what the receiver expects."""


class SyncTimeout(SyncError, TimeoutError):
    """A sync wait passed its deadline (`rollout.weight_sync.timeout_s`): the peer died or hung."""
