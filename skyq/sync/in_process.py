"""In-process transport: two queues, for tests and same-process setups (topology=1gpu).

Frames are copied on send, so a sender reusing its buffer cannot change what was delivered, which
is what a real transport guarantees. A sender that hands over a buffer it never touches again
(`give_frame`: a weight sync's buckets) skips the copy: on one GPU that is a device copy of every
synced byte less, and half the sync's peak memory (the buckets are not held twice).
"""

from __future__ import annotations

import queue

from torch import Tensor

from skyq.sync.channel import check_frame_length
from skyq.sync.errors import SyncError, SyncTimeout

_ABORT = object()
"""Marks an abort notice in a queue: (_ABORT, reason)."""


class InProcessChannel:
    """One end of an in-process frame channel (see `in_process_pair`)."""

    def __init__(self, outbox: queue.Queue, inbox: queue.Queue, *, timeout_s: float, side: str) -> None:
        self._outbox = outbox
        self._inbox = inbox
        self._timeout_s = timeout_s
        self._side = side
        self._closed = False

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise SyncError(f"{what}: the {self._side}'s channel is closed")

    def send_frame(self, payload: Tensor) -> None:
        self._check_open("send")
        self._outbox.put(payload.detach().clone())

    def give_frame(self, payload: Tensor) -> None:
        """`send_frame` of a tensor the caller hands over: it must never write it again (the
        receiver gets this very tensor, no copy)."""
        self._check_open("send")
        self._outbox.put(payload.detach())

    def recv_frame(self, max_bytes: int, what: str) -> Tensor:
        self._check_open(what)
        try:
            frame = self._inbox.get(timeout=self._timeout_s)
        except queue.Empty:
            raise SyncTimeout(
                f"{what}: the {self._side} waited {self._timeout_s:.1f} s and nothing arrived "
                "(rollout.weight_sync.timeout_s); is the peer running?"
            ) from None
        if isinstance(frame, tuple) and frame[0] is _ABORT:
            raise SyncError(f"{what}: the {_PEER[self._side]} gave up: {frame[1]}")
        check_frame_length(frame.numel(), max_bytes, what)
        return frame

    def abort(self, reason: str) -> None:
        """Tell the peer this side gave up on the current sync: its pending (or next) receive fails at
        once with `reason` instead of waiting out its deadline. Only for a sync that is being abandoned."""
        self._outbox.put((_ABORT, reason))

    def close(self) -> None:
        """Refuse further use (the queues themselves are garbage-collected with the channel)."""
        self._closed = True


_PEER = {"sender": "receiver", "receiver": "sender"}


def in_process_pair(timeout_s: float) -> tuple[InProcessChannel, InProcessChannel]:
    """(sender end, receiver end) of a fresh in-process channel."""
    to_receiver: queue.Queue = queue.Queue()
    to_sender: queue.Queue = queue.Queue()
    sender = InProcessChannel(to_receiver, to_sender, timeout_s=timeout_s, side="sender")
    receiver = InProcessChannel(to_sender, to_receiver, timeout_s=timeout_s, side="receiver")
    return sender, receiver
