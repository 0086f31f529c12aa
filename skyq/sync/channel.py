"""The two-party byte channel a weight sync runs over, and JSON messages on top of it.

A channel moves frames: flat uint8 tensors whose length travels first, so the receiver allocates
exactly what was announced (and refuses an absurd announcement). Every receive has a deadline.
Control messages (the manifest, acknowledgements) are JSON frames; nothing is ever pickled.
"""

from __future__ import annotations

import json
from typing import Any, Protocol

import torch
from torch import Tensor

from skyq.sync.errors import SyncError

MAX_CONTROL_BYTES = 256 * 1024 * 1024
"""Largest JSON frame (manifest or ack) a receiver accepts."""


class Channel(Protocol):
    """One end of a two-party frame channel (sender and receiver ends look alike)."""

    def send_frame(self, payload: Tensor) -> None:
        """Send a flat uint8 tensor; raises `SyncError`/`SyncTimeout` if the peer is gone."""

    def recv_frame(self, max_bytes: int, what: str) -> Tensor:
        """Receive the peer's next frame (at most `max_bytes`); `what` names it in errors."""

    def close(self) -> None:
        """Release the channel's resources."""


def give_frame(channel: Channel, payload: Tensor) -> None:
    """Send `payload`, which the caller hands over and never writes again: through the channel's
    `give_frame` when it has one (no defensive copy, e.g. `InProcessChannel`), else `send_frame`."""
    give = getattr(channel, "give_frame", None)
    if give is not None:
        give(payload)
    else:
        channel.send_frame(payload)


def send_bytes(channel: Channel, raw: bytes) -> None:
    """Send raw bytes (a JSON document) as one frame."""
    channel.send_frame(torch.frombuffer(bytearray(raw), dtype=torch.uint8))


def send_json(channel: Channel, obj: Any) -> None:
    """Send `obj` as a JSON frame."""
    send_bytes(channel, json.dumps(obj, separators=(",", ":")).encode())


def recv_json_bytes(channel: Channel, what: str, max_bytes: int = MAX_CONTROL_BYTES) -> bytes:
    """Receive a JSON frame as raw bytes (the caller parses it strictly)."""
    return channel.recv_frame(max_bytes, what).cpu().numpy().tobytes()


def recv_json(channel: Channel, what: str) -> dict[str, Any]:
    """Receive a JSON object frame."""
    raw = recv_json_bytes(channel, what)
    try:
        obj = json.loads(raw.decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SyncError(f"{what}: peer sent a frame that is not JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise SyncError(f"{what}: expected a JSON object, got {type(obj).__name__}")
    return obj


def check_frame_length(n: int, max_bytes: int, what: str) -> None:
    """Refuse a negative or oversized frame announcement before allocating for it."""
    if n < 0 or n > max_bytes:
        raise SyncError(f"{what}: peer announced a frame of {n} bytes (limit {max_bytes}); refusing it")
