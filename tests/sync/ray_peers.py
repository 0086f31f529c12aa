"""Ray actors that run one end of a real gloo weight-sync group, for the transport tests.

They hold plain tensors (`wire_fixtures`), so the transport is tested with real processes, a real
gloo group and real failures, but without model code.
"""

from __future__ import annotations

import hashlib
import os
import time

import torch

from skyq.sync.errors import SyncError
from skyq.sync.receiver import WeightReceiver
from skyq.sync.sender import WeightSender
from skyq.sync.torch_dist import RECEIVER_RANK, SENDER_RANK, TorchDistChannel, connect_store, open_store

from .wire_fixtures import DictEngine, expected_units, fp8_like_serialize, random_weights


def weights_for(seed: int, nan_in: str | None = None) -> dict[str, torch.Tensor]:
    weights = random_weights(torch.Generator().manual_seed(seed))
    if nan_in is not None:
        weights[nan_in].view(-1)[0] = float("nan")
    return weights


class SenderPeer:
    def open_store(self, timeout_s: float) -> int:
        self.store = open_store(timeout_s)
        self.timeout_s = timeout_s
        return self.store.port

    def join(self) -> None:
        self.channel = TorchDistChannel(
            self.store, rank=SENDER_RANK, timeout_s=self.timeout_s, device=torch.device("cpu")
        )

    def sync(self, seed: int, version: int, bucket_bytes: int, nan_in: str | None = None) -> dict:
        """Returns {"stats": ...} or {"error": (class name, message), "elapsed_s": ...}; never raises."""
        start = time.monotonic()
        sender = WeightSender(self.channel, serialize=fp8_like_serialize, bucket_bytes=bucket_bytes)
        try:
            stats = sender.sync(weights_for(seed, nan_in).items(), version)
        except SyncError as exc:
            return {"error": (type(exc).__name__, str(exc)), "elapsed_s": time.monotonic() - start}
        return {"stats": stats.as_metrics(), "elapsed_s": time.monotonic() - start}

    def ping(self) -> int:
        return os.getpid()


class DyingChannel:
    """Passes frames through, then kills its process on the n-th receive: an engine dying mid-sync."""

    def __init__(self, inner: TorchDistChannel, die_on_frame: int) -> None:
        self.inner, self.die_on_frame, self.received = inner, die_on_frame, 0

    def send_frame(self, payload):
        self.inner.send_frame(payload)

    def recv_frame(self, max_bytes, what):
        if self.received == self.die_on_frame:
            os._exit(1)
        self.received += 1
        return self.inner.recv_frame(max_bytes, what)

    def close(self):
        self.inner.close()


class ReceiverPeer:
    def __init__(self) -> None:
        self.engine = DictEngine()

    def join(self, port: int, timeout_s: float) -> None:
        store = connect_store(port, timeout_s)
        self.channel = TorchDistChannel(
            store, rank=RECEIVER_RANK, timeout_s=timeout_s, device=torch.device("cpu")
        )

    def receive(self, seed: int, die_on_frame: int | None = None) -> dict:
        channel = self.channel if die_on_frame is None else DyingChannel(self.channel, die_on_frame)
        receiver = WeightReceiver(channel, expected_units(weights_for(seed)), verify_checksum=True)
        start = time.monotonic()
        try:
            receiver.receive(current_version=self.engine.version, commit=self.engine.commit)
        except SyncError as exc:
            return {"error": (type(exc).__name__, str(exc)), "elapsed_s": time.monotonic() - start}
        return {"version": self.engine.version}

    def state(self) -> dict:
        """Weight version and, per wire tensor, (dtype, shape, sha256 of its bytes)."""
        return {
            "version": self.engine.version,
            "tensors": {n: (str(t.dtype), tuple(t.shape), sha256(t)) for n, t in self.engine.wire.items()},
        }


def sha256(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def serialized_state(seed: int) -> dict:
    """What the receiver must hold after syncing `weights_for(seed)`, computed in this process."""
    wire = {n: t for name, w in weights_for(seed).items() for n, t in fp8_like_serialize(name, w).items()}
    return {n: (str(t.dtype), tuple(t.shape), sha256(t)) for n, t in wire.items()}
