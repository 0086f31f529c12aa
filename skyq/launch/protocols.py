"""The two worker protocols the run loop drives: a trainer and a rollout engine, whatever the backend.

`WorkerPair` (`skyq.launch.pair`) calls these methods and no others, in the driver process or as Ray
actor calls, so a backend's worker class implements exactly this surface (a registry test checks
every registered class against it, signatures included). Weights never travel as call arguments:
they move only through the sync channel the two sides join (`open_sync_store` / `join_sync_group`,
or `use_channel` in one process), accounted and verified by skyq's sync (`skyq.sync`).
"""

from __future__ import annotations

import inspect
from typing import Protocol, runtime_checkable

from skyq.config.resolve import WorkerResolution
from skyq.launch.checkpointing import PendingCheckpoint
from skyq.rl.batch import RolloutBatch, Sample
from skyq.sync.channel import Channel
from skyq.sync.plan_wire import WireDigest


@runtime_checkable
class TrainerWorkerApi(Protocol):
    """The trainer side: updates the policy and sends its weights in the precision's wire format."""

    def report_resolution(self) -> WorkerResolution:
        """The precision settings this worker resolved from its own device (fp8 recipe, scales)."""

    def build_seconds(self) -> float:
        """Seconds its constructor took (start-up feedback)."""

    def open_sync_store(self, timeout_s: float) -> int:
        """Open one engine's rendezvous store on loopback; its port. Called once per engine, in order."""

    def join_sync_group(self, sync_device: str) -> None:
        """Form the sync group of every opened store (each engine joins its own)."""

    def use_channel(self, channel: Channel) -> None:
        """Send over an in-process channel instead (the one-process layout)."""

    def abort_sync(self, reason: str) -> None:
        """Wake engines waiting on a sync the trainer gave up, where the channel can."""

    def send_weights(self, version: int, bucket_bytes: int) -> dict[str, float]:
        """Serialize the current weights and send them as `version` to every engine; the sync metrics."""

    def serialized_digest(self) -> WireDigest:
        """Digest of the wire tensors the current weights serialize to (what an engine must hold)."""

    def train_step(self, batch: RolloutBatch) -> dict[str, float]:
        """One policy update on `batch`; its metrics (loss, grad_norm, lr, train/rollout mismatch)."""

    def save_state(self, path: str) -> str:
        """Write the trainer's state to `path` now (crash-safe); its sha256."""

    def start_save_state(self, checkpoint: PendingCheckpoint) -> None:
        """Snapshot the state and write and commit `checkpoint` in the background."""

    def wait_save_state(self) -> str:
        """Wait for the background save; the committed checkpoint directory."""

    def load_state(self, path: str) -> int:
        """Restore a saved state; the trainer's step."""

    def close(self) -> None:
        """Release the sync channels (and any background save)."""


@runtime_checkable
class RolloutWorkerApi(Protocol):
    """The rollout side: holds the policy's weights as received, samples with log-probs."""

    def report_resolution(self) -> WorkerResolution:
        """The precision settings this worker resolved from its own device."""

    def build_seconds(self) -> float:
        """Seconds its constructor took (engine boot)."""

    def join_sync_group(self, port: int, timeout_s: float, sync_device: str) -> None:
        """Join the trainer's sync group at `port`."""

    def use_channel(self, channel: Channel) -> None:
        """Receive over an in-process channel instead (the one-process layout)."""

    def receive_weights(self, verify_checksum: bool) -> dict[str, float]:
        """Take part in one sync; weights and version change only if every tensor is accounted and
        verified. Returns at least {"version": the committed version}."""

    def generate(
        self,
        prompts: list[list[int]],
        *,
        n: int,
        max_new_tokens: int,
        temperature: float,
        top_p: float,
        seed: int,
    ) -> list[Sample]:
        """`n` samples of each prompt (prompt-major), each with the engine's per-token log-probs."""

    def weight_version(self) -> int:
        """The version of the weights the engine serves."""

    def wire_digest(self) -> WireDigest:
        """Digest of the wire tensors the engine last committed (compared with the trainer's)."""

    def close(self) -> None:
        """Release the sync channel and shut down whatever the engine started."""


def protocol_methods(protocol: type) -> list[str]:
    """The method names a protocol declares (what a backend's class must define)."""
    return sorted(
        name for name, value in vars(protocol).items() if callable(value) and not name.startswith("_")
    )


def missing_methods(cls: type, protocol: type) -> list[str]:
    """Methods of `protocol` that `cls` does not define."""
    return [name for name in protocol_methods(protocol) if not callable(getattr(cls, name, None))]


def conformance_problems(cls: type, protocol: type) -> list[str]:
    """What keeps `cls` from serving as `protocol`: missing methods, or parameters the protocol passes
    that the class's method does not take."""
    problems = [f"{cls.__name__} has no `{name}`" for name in missing_methods(cls, protocol)]
    for name in protocol_methods(protocol):
        method = getattr(cls, name, None)
        if not callable(method):
            continue
        want = inspect.signature(getattr(protocol, name)).parameters
        have = inspect.signature(method).parameters
        takes_kwargs = any(p.kind is p.VAR_KEYWORD for p in have.values())
        for pname in want:
            if pname != "self" and pname not in have and not takes_kwargs:
                problems.append(f"{cls.__name__}.{name} does not take `{pname}`")
    return problems


def check_conforms(cls: type, protocol: type, what: str) -> None:
    """Raise `TypeError` listing what keeps `cls` from serving as `protocol`."""
    problems = conformance_problems(cls, protocol)
    if problems:
        raise TypeError(
            f"{what} {cls.__module__}.{cls.__name__} does not implement the protocol: " + "; ".join(problems)
        )


__all__ = [
    "RolloutWorkerApi",
    "TrainerWorkerApi",
    "check_conforms",
    "conformance_problems",
    "protocol_methods",
]
