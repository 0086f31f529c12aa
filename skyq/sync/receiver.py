"""Engine side of a weight sync: receive -> verify -> commit, accounting for every tensor.

Before any bucket is read, the manifest is checked against what the engine expects (the plan's wire
tensors): the version must be newer than the one held, and every expected tensor must be announced
with its shape and dtype, and nothing else. A same-layout message (layout.py) is accepted only if it
names the layout of the last sync this receiver committed, which passed those checks then. After the buckets arrive their checksums and values are
verified, and only then is `commit(wire, version)` called: it is the one place the engine's weights
and version change. Any failure is acknowledged to the sender with the reason and re-raised here.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from skyq.sync.channel import Channel, recv_json_bytes, send_json
from skyq.sync.checksums import checksum_algorithm
from skyq.sync.errors import SyncError, SyncRefused
from skyq.sync.layout import ReceiverLayout, SameLayout, no_layout_refusal
from skyq.sync.manifest import SyncManifest, parse_message_json
from skyq.sync.scan import PendingScan
from skyq.sync.values import check_received_values
from skyq.sync.wire_dtypes import dtype_name
from skyq.sync.wire_state import WireState

Commit = Callable[[dict[str, Tensor], int], None]
"""Installs a verified wire state dict as the given weight version (atomic on the engine side)."""

_MAX_LISTED = 6


@dataclass(frozen=True, slots=True)
class ExpectedUnit:
    """A source parameter the engine expects, with each wire tensor's shape and dtype."""

    source: str
    tensors: dict[str, tuple[tuple[int, ...], torch.dtype]]


@dataclass(frozen=True, slots=True)
class ReceiveStats:
    version: int
    num_tensors: int
    bytes: int
    recv_s: float
    load_s: float


def check_version(version: int, current_version: int) -> None:
    """Refuse a version that is not newer than the one the engine holds."""
    if version <= current_version:
        kind = "a duplicate" if version == current_version else "an older"
        raise SyncRefused(
            f"weight version {version} is {kind} version: the engine already holds version "
            f"{current_version}, and versions only move forward"
        )


def check_accounting(manifest: SyncManifest, expected: Sequence[ExpectedUnit], current_version: int) -> None:
    """Refuse a manifest whose version is not newer, or whose tensors differ from `expected`."""
    check_version(manifest.version, current_version)
    announced = {t.name: t for t in manifest.tensors}
    expected_by_name = {name: (unit, spec) for unit in expected for name, spec in unit.tensors.items()}
    problems: list[str] = []
    for name, entry in announced.items():
        if name not in expected_by_name:
            problems.append(
                f"unknown tensor `{name}` (from `{entry.unit}`): the engine's plan has no such name"
            )
            continue
        unit, (shape, dtype) = expected_by_name[name]
        if entry.unit != unit.source:
            problems.append(
                f"`{name}` arrived as part of `{entry.unit}`, the plan puts it in `{unit.source}`"
            )
        if tuple(entry.shape) != tuple(shape) or entry.dtype != dtype_name(dtype):
            problems.append(
                f"`{name}` arrived as {entry.dtype}{list(entry.shape)}, the plan expects {dtype_name(dtype)}{list(shape)}"
            )
    for unit in expected:
        present = [n for n in unit.tensors if n in announced]
        missing = [n for n in unit.tensors if n not in announced]
        if missing and present:
            problems.append(
                f"`{unit.source}`: received {present} without {missing}; a weight and its scales must travel together"
            )
        elif missing:
            problems.append(f"`{unit.source}` was dropped: none of {missing} is in the sync")
    if problems:
        listed = "; ".join(problems[:_MAX_LISTED])
        more = f" (and {len(problems) - _MAX_LISTED} more)" if len(problems) > _MAX_LISTED else ""
        raise SyncRefused(
            f"weight version {manifest.version} does not match the engine's plan: {listed}{more}. "
            "The trainer and the engine must be built from the same model and precision config."
        )


class WeightReceiver:
    """Receives weight syncs over one channel and commits them through `commit`.

    Keep one receiver per channel: it remembers the layout of the last sync it committed
    (`layout.ReceiverLayout`), which a later same-layout sync from the same sender refers to."""

    def __init__(
        self,
        channel: Channel,
        expected: Sequence[ExpectedUnit],
        *,
        verify_checksum: bool,
        device: torch.device | str | None = None,
    ) -> None:
        """`device`: where the engine holds its weights; frames that arrive elsewhere (host memory,
        over gloo from a trainer on the same GPU) are copied there, one copy per bucket, before they
        are verified, so the checks and the commit run on it. None: where they arrive."""
        self._channel = channel
        self._expected = list(expected)
        self._verify_checksum = verify_checksum
        self._device = None if device is None else torch.device(device)
        self._layout: ReceiverLayout | None = None
        """The layout of the last committed sync: accounted for against `expected` already."""

    def receive(self, *, current_version: int, commit: Commit) -> ReceiveStats:
        """Run one sync; the engine holds `current_version` before it."""
        start = time.perf_counter()
        raw = recv_json_bytes(self._channel, "weight-sync manifest")
        cached, self._layout = self._layout, None  # set again only once this sync committed
        version = -1
        try:
            obj = parse_message_json(raw, "manifest")
            version = obj["version"] if isinstance(obj.get("version"), int) else -1
            if "buckets" in obj:
                manifest = SyncManifest.from_json(obj)
                check_accounting(manifest, self._expected, current_version)
                layout = ReceiverLayout.of(manifest, obj["layout"])  # checked by from_json
                checksums = [b.checksum for b in manifest.buckets]
            else:
                message = SameLayout.from_json(obj)
                check_version(message.version, current_version)
                if cached is None:
                    raise no_layout_refusal(message)
                cached.check_same(message)
                layout, checksums = cached, list(message.checksums)
        except SyncRefused as exc:
            # Answer the refusal so the sender stops instead of pushing buckets nobody will read.
            self._ack("manifest", version, error=str(exc))
            raise
        self._ack("manifest", version)
        n = len(layout.bucket_nbytes)
        frames = [
            self._channel.recv_frame(nbytes, f"bucket {i + 1}/{n} of v{version}")
            for i, nbytes in enumerate(layout.bucket_nbytes)
        ]
        received = time.perf_counter()
        try:
            wire = self._verify(frames, layout, checksums, version)
            commit(wire, version)
        except SyncError as exc:
            self._ack("commit", version, error=str(exc))
            raise
        except ValueError as exc:
            # The engine's own validation (plan, shapes, values) refused the weights.
            self._ack("commit", version, error=f"{type(exc).__name__}: {exc}")
            raise SyncRefused(f"the engine refused to commit weight version {version}: {exc}") from exc
        except Exception as exc:
            self._ack("commit", version, error=f"{type(exc).__name__}: {exc}")
            raise
        self._layout = layout
        load_s = time.perf_counter() - received
        self._ack("commit", version, num_tensors=len(wire), nbytes=layout.total_bytes, load_s=load_s)
        return ReceiveStats(
            version=version,
            num_tensors=len(wire),
            bytes=layout.total_bytes,
            recv_s=received - start,
            load_s=load_s,
        )

    def _verify(
        self, frames: Sequence[Tensor], layout: ReceiverLayout, checksums: Sequence[str], version: int
    ) -> WireState:
        """The frames (moved to the receiver's device) as a `WireState`, refused if a frame has the
        wrong size, (when enabled) its checksum differs, or a value is non-finite / a NaN code. The
        device work of the checksums and the value checks is queued first and read back in one
        host transfer, and the commit's word views are made while the device runs it (one pass over
        the bytes with the Triton scan kernel on CUDA, `scan.PendingScan`)."""
        for i, (frame, nbytes) in enumerate(zip(frames, layout.bucket_nbytes)):
            if frame.dtype != torch.uint8 or frame.ndim != 1 or frame.numel() != nbytes:
                raise SyncRefused(
                    f"weight version {version}, bucket {i}: received {frame.numel()} bytes ({frame.dtype}), "
                    f"the layout says {nbytes}"
                )
        if self._device is not None:
            frames = [frame.to(self._device) for frame in frames]
        scan = PendingScan(
            frames,
            layout.spans,
            layout.scan,
            [checksum_algorithm(c) for c in checksums],
            checksums=self._verify_checksum,
        )
        wire = layout.unpack(frames)
        if len(wire) != layout.num_tensors:
            raise SyncError(f"weight version {version}: placed {len(wire)} of {layout.num_tensors} tensors")
        if frames and frames[0].device.type != "cpu":
            wire.word_runs()  # host work that overlaps the queued device work (cached for the commit)
        got, bad = scan.read()
        if self._verify_checksum:
            for i, (have, want) in enumerate(zip(got, checksums, strict=True)):
                if have != want:
                    names = ", ".join(r.names[0] for r in layout.runs[i][:3])
                    raise SyncRefused(
                        f"weight version {version}: bucket {i} (holding {names}, ...) arrived corrupted: "
                        f"checksum {have} != manifest {want}"
                    )
        if bad:
            check_received_values(wire)
        return wire

    def _ack(
        self,
        stage: str,
        version: int,
        *,
        error: str = "",
        num_tensors: int = 0,
        nbytes: int = 0,
        load_s: float = 0.0,
    ) -> None:
        send_json(
            self._channel,
            {
                "stage": stage,
                "ok": not error,
                "version": version,
                "error": error,
                "num_tensors": num_tensors,
                "bytes": nbytes,
                "load_s": load_s,
            },
        )
