"""The trainer's sending ends of the weight sync, one per engine of the rollout group.

Every trainer backend's worker (`skyq.launch.actors.TrainerWorker`, the Megatron worker's rank 0)
holds one `EngineSenders`: it opens one rendezvous store per engine, forms each two-rank sync group
(or takes an in-process channel), and sends a version to every engine in engine order, each through
its own `WeightSender` (which keeps the layout that engine committed, so a same-layout sync sends a
short reference instead of the full manifest).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from skyq.sync.channel import Channel
from skyq.sync.sender import Serializer, WeightItem, WeightSender
from skyq.sync.torch_dist import SENDER_RANK, TorchDistChannel, open_store


class EngineSenders:
    """One sync channel and sender per engine, in engine order."""

    def __init__(self, serialize: Serializer) -> None:
        self.serialize = serialize
        self._timeout_s: float | None = None
        self._stores: list = []
        self.channels: list[Channel] = []
        self._senders: list[WeightSender | None] = []
        self._bucket_bytes: int | None = None

    def open_store(self, timeout_s: float) -> int:
        """Start one engine's rendezvous store on a free loopback port (held from now on); its port.
        Called once per engine of the rollout group, in engine order."""
        self._timeout_s = timeout_s
        store = open_store(timeout_s)
        self._stores.append(store)
        return store.port

    def join(self, sync_device: str) -> None:
        """Form the two-rank group of every opened store, in engine order (each engine joins its own)."""
        self.channels = [
            TorchDistChannel(
                store, rank=SENDER_RANK, timeout_s=self._timeout_s, device=torch.device(sync_device)
            )
            for store in self._stores
        ]
        self._senders = [None] * len(self.channels)

    def use(self, channel: Channel) -> None:
        """Send over `channel` (an in-process pair's sender end) instead of a torch.distributed group."""
        self.channels, self._senders = [channel], [None]

    def abort(self, reason: str) -> None:
        """Wake the engines waiting on this sync, where the channel can (the in-process one can)."""
        for channel in self.channels:
            abort = getattr(channel, "abort", None)
            if abort is not None:
                abort(reason)

    def send(
        self, items: Callable[[], Iterable[WeightItem]], version: int, bucket_bytes: int
    ) -> dict[str, float]:
        """Send `items()` (called once per engine: a fresh iterator each time) as `version` to every
        engine, one after the other (each verifies and commits its copy); the sync metrics, times
        summed over the engines."""
        if self._bucket_bytes != bucket_bytes:
            self._senders = [None] * len(self.channels)
            self._bucket_bytes = bucket_bytes
        total: dict[str, float] = {}
        for i, channel in enumerate(self.channels):
            if self._senders[i] is None:
                self._senders[i] = WeightSender(channel, serialize=self.serialize, bucket_bytes=bucket_bytes)
            try:
                metrics = self._senders[i].sync(items(), version).as_metrics()
            except Exception as exc:
                if len(self.channels) > 1:
                    exc.add_note(f"(sending to engine {i} of {len(self.channels)})")
                raise
            for key, value in metrics.items():
                total[key] = total.get(key, 0.0) + value if key.endswith("_s") else value
        return total

    def close(self) -> None:
        for channel in self.channels:
            channel.close()


class SendsToEngines:
    """The trainer protocol's sync-channel methods (`skyq.launch.protocols.TrainerWorkerApi`) for a
    worker whose `senders` is an `EngineSenders`: every trainer backend's worker inherits them."""

    senders: EngineSenders

    def open_sync_store(self, timeout_s: float) -> int:
        """One engine's rendezvous store on a free loopback port; its port (in engine order)."""
        return self.senders.open_store(timeout_s)

    def join_sync_group(self, sync_device: str) -> None:
        """Form the two-rank group of every opened store, in engine order (each engine joins its own)."""
        self.senders.join(sync_device)

    def use_channel(self, channel: Channel) -> None:
        """Send over `channel` (an in-process pair's sender end) instead of a torch.distributed group."""
        self.senders.use(channel)

    def abort_sync(self, reason: str) -> None:
        """Wake the engines waiting on this sync, where the channel can (the in-process one can)."""
        self.senders.abort(reason)
