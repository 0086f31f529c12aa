"""Engine side of a weight sync: receive -> verify -> commit, accounting for every tensor.

Before any bucket is read, the manifest is checked against what the engine expects (the plan's wire
tensors): the version must be newer than the one held, and every expected tensor must be announced
with its shape and dtype, and nothing else. After the buckets arrive their checksums and values are
verified, and only then is `commit(wire, version)` called: it is the one place the engine's weights
and version change. Any failure is acknowledged to the sender with the reason and re-raised here.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from skyq.quant.errors import QuantizationError, check_finite, check_no_e4m3_nan
from skyq.sync.buckets import unpack_bucket
from skyq.sync.channel import Channel, recv_json_bytes, send_json
from skyq.sync.errors import SyncError, SyncRefused
from skyq.sync.manifest import SyncManifest
from skyq.sync.wire_dtypes import dtype_name

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


def check_accounting(manifest: SyncManifest, expected: Sequence[ExpectedUnit], current_version: int) -> None:
    """Refuse a manifest whose version is not newer, or whose tensors differ from `expected`."""
    if manifest.version <= current_version:
        kind = "a duplicate" if manifest.version == current_version else "an older"
        raise SyncRefused(
            f"weight version {manifest.version} is {kind} version: the engine already holds version "
            f"{current_version}, and versions only move forward"
        )
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


_FLOATS = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
_GROUP_BYTES = 256 * 1024 * 1024
"""Tensors are tested in groups of at most this many bytes (one concatenation, one reduction)."""


def _groups(wire: dict[str, Tensor]) -> list[list[Tensor]]:
    """The checked tensors grouped by (device, dtype), in order, each group at most `_GROUP_BYTES`."""
    open_groups: dict[tuple[torch.device, torch.dtype], tuple[list[Tensor], list[int]]] = {}
    done: list[list[Tensor]] = []
    for t in wire.values():
        if t.dtype not in _FLOATS and t.dtype != torch.float8_e4m3fn:
            continue
        members, size = open_groups.setdefault((t.device, t.dtype), ([], [0]))
        nbytes = t.numel() * t.element_size()
        if members and size[0] + nbytes > _GROUP_BYTES:
            done.append(list(members))
            members.clear()
            size[0] = 0
        members.append(t)
        size[0] += nbytes
    return done + [members for members, _ in open_groups.values() if members]


def _values_look_valid(wire: dict[str, Tensor]) -> bool:
    """A few device-side tests and one host read per device: True when no float sum is non-finite
    and no e4m3 byte is a NaN code. Tensors of one dtype are concatenated and tested together.
    False may be a false alarm (a sum of finite values that overflowed), which the exact
    per-tensor checks then clear."""
    flags: dict[torch.device, list[Tensor]] = {}
    for group in _groups(wire):
        e4m3 = group[0].dtype == torch.float8_e4m3fn
        parts = [t.reshape(-1).view(torch.uint8) if e4m3 else t.reshape(-1) for t in group]
        flat = parts[0] if len(parts) == 1 else torch.cat(parts)
        if e4m3:
            bad = ((flat & 0x7F) == 0x7F).any()
        else:
            acc = torch.float64 if flat.dtype == torch.float64 else torch.float32
            bad = torch.isfinite(flat.sum(dtype=acc)).logical_not()
        flags.setdefault(flat.device, []).append(bad.reshape(1))
    return not any(bool(torch.cat(f).any()) for f in flags.values())


def check_received_values(wire: dict[str, Tensor]) -> None:
    """Refuse non-finite floats and NaN-coded e4m3 bytes that arrived intact (bad at the source)."""
    if _values_look_valid(wire):
        return
    try:
        for name, t in wire.items():
            if t.dtype in _FLOATS:
                check_finite(t, name)
            elif t.dtype == torch.float8_e4m3fn:
                check_no_e4m3_nan(t, name)
    except QuantizationError as exc:
        raise SyncRefused(f"received weights are unusable: {exc}") from exc


class WeightReceiver:
    """Receives full weight syncs over one channel and commits them through `commit`."""

    def __init__(self, channel: Channel, expected: Sequence[ExpectedUnit], *, verify_checksum: bool) -> None:
        self._channel = channel
        self._expected = list(expected)
        self._verify_checksum = verify_checksum

    def receive(self, *, current_version: int, commit: Commit) -> ReceiveStats:
        """Run one sync; the engine holds `current_version` before it."""
        start = time.perf_counter()
        raw = recv_json_bytes(self._channel, "weight-sync manifest")
        version = -1
        try:
            manifest = SyncManifest.from_json_bytes(raw)
            version = manifest.version
            check_accounting(manifest, self._expected, current_version)
        except SyncRefused as exc:
            # Answer the refusal so the sender stops instead of pushing buckets nobody will read.
            self._ack("manifest", version, error=str(exc))
            raise
        self._ack("manifest", version)
        frames = [
            self._channel.recv_frame(b.nbytes, f"bucket {b.index + 1}/{len(manifest.buckets)} of v{version}")
            for b in manifest.buckets
        ]
        received = time.perf_counter()
        try:
            wire: dict[str, Tensor] = {}
            for frame, entry in zip(frames, manifest.buckets):
                wire.update(unpack_bucket(frame, entry, verify_checksum=self._verify_checksum))
            if len(wire) != len(manifest.tensors):
                raise SyncError(
                    f"weight version {version}: placed {len(wire)} of {len(manifest.tensors)} tensors"
                )
            check_received_values(wire)
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
        load_s = time.perf_counter() - received
        self._ack("commit", version, num_tensors=len(wire), nbytes=manifest.total_bytes, load_s=load_s)
        return ReceiveStats(
            version=version,
            num_tensors=len(wire),
            bytes=manifest.total_bytes,
            recv_s=received - start,
            load_s=load_s,
        )

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
