"""Group serialized units into byte buckets of bounded size, and unpack them on arrival.

A unit (a weight and its scales) is never split: a bucket holds whole units and is closed when the
next unit would push it past `bucket_bytes`. A single unit larger than `bucket_bytes` travels alone
in a bucket of its own size, because splitting it would separate a weight from its scales.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from skyq.sync.byte_runs import aligned, gather, interleave, plan_copies, unpack_views
from skyq.sync.checksums import bucket_checksum, checksum_algorithm
from skyq.sync.errors import SyncRefused
from skyq.sync.manifest import BucketEntry, TensorEntry
from skyq.sync.wire_dtypes import as_bytes, dtype_name


@dataclass(frozen=True, slots=True)
class WireUnit:
    """One source parameter as it crosses the wire: wire name -> tensor (its weight and scales)."""

    source: str
    tensors: dict[str, Tensor]

    @property
    def packed_bytes(self) -> int:
        """Bytes this unit takes in a bucket, alignment padding included."""
        return sum(aligned(t.numel() * t.element_size()) for t in self.tensors.values())


@dataclass(frozen=True, slots=True)
class WireStack:
    """The units of one stacked item, held as whole tensors: member i is the unit `sources[i]`, whose
    wire tensors are `tensors[k][i]`, named `names[k][i]`, for every wire position k. The sender
    packs a repeat sync straight from `tensors` (one copy per bucket range, no per-member work)."""

    sources: tuple[str, ...]
    names: tuple[tuple[str, ...], ...]
    tensors: tuple[Tensor, ...]

    def units(self) -> list[WireUnit]:
        """One `WireUnit` per member (views of `tensors`)."""
        values = zip(*(t.unbind(0) for t in self.tensors))
        return [
            WireUnit(source=source, tensors=dict(zip(keys, vals)))
            for source, keys, vals in zip(self.sources, zip(*self.names), values)
        ]


def plan_buckets(units: Sequence[WireUnit], bucket_bytes: int) -> list[list[WireUnit]]:
    """Split `units` (in order) into buckets of at most `bucket_bytes`, never splitting a unit."""
    if bucket_bytes < 1:
        raise SyncRefused(f"rollout.weight_sync.bucket_bytes={bucket_bytes}: must be at least 1")
    buckets: list[list[WireUnit]] = []
    current: list[WireUnit] = []
    current_bytes = 0
    for unit in units:
        size = unit.packed_bytes
        if current and current_bytes + size > bucket_bytes:
            buckets.append(current)
            current, current_bytes = [], 0
        current.append(unit)
        current_bytes += size
    if current:
        buckets.append(current)
    return buckets


def bucket_entries(units: Sequence[WireUnit]) -> tuple[tuple[TensorEntry, ...], list[tuple[int, int]], int]:
    """Where each tensor of `units` lies in their bucket: (entries in byte order, the (unit,
    position) of each, the bucket's bytes). Tensors go in `interleave` order (every unit's weight,
    then every unit's scales), so views of one batched output are one byte range; each offset is
    aligned to `ALIGN_BYTES`, the gaps are zero padding."""
    lists = [list(unit.tensors.items()) for unit in units]
    order = interleave(lists)
    entries: list[TensorEntry] = []
    offset = end = 0
    for u, k in order:
        name, t = lists[u][k]
        nbytes = t.numel() * t.element_size()
        entries.append(
            TensorEntry(
                name=name,
                unit=units[u].source,
                dtype=dtype_name(t.dtype),
                shape=tuple(t.shape),
                offset=offset,
                nbytes=nbytes,
            )
        )
        end = offset + nbytes
        offset += aligned(nbytes)
    return tuple(entries), order, end


def pack_bucket(index: int, units: Sequence[WireUnit]) -> tuple[Tensor, BucketEntry]:
    """Lay the units' bytes into one flat uint8 buffer (`bucket_entries`, one `torch.cat` of the
    tensors and padding) and describe where each tensor lies."""
    entries, order, nbytes = bucket_entries(units)
    tensors = [list(units[u].tensors.values())[k] for u, k in order]
    device = tensors[0].device if tensors else torch.device("cpu")
    copies = plan_copies(
        [e.offset for e in entries],
        [e.nbytes for e in entries],
        [(u, k, 0) for u, k in order],
        [False] * len(units),
    )
    # Padding is zeros, so the bytes (and hence the checksum) are deterministic.
    buf = gather([as_bytes(t) for t in tensors], copies, nbytes, device)
    return buf, BucketEntry(index=index, nbytes=nbytes, checksum=bucket_checksum(buf), tensors=entries)


def unpack_bucket(buf: Tensor, entry: BucketEntry, *, verify_checksum: bool) -> dict[str, Tensor]:
    """The tensors of a received bucket with the dtypes and shapes the manifest names: views into
    `buf` (which the caller hands over and must not reuse), a copy only where a view cannot be taken."""
    if buf.dtype != torch.uint8 or buf.ndim != 1 or buf.numel() != entry.nbytes:
        raise SyncRefused(
            f"bucket {entry.index}: received {buf.numel()} bytes ({buf.dtype}), manifest says {entry.nbytes}"
        )
    if verify_checksum:
        got = bucket_checksum(buf, checksum_algorithm(entry.checksum))
        if got != entry.checksum:
            names = ", ".join(t.name for t in entry.tensors[:3])
            raise SyncRefused(
                f"bucket {entry.index} (holding {names}{', ...' if len(entry.tensors) > 3 else ''}) arrived "
                f"corrupted: checksum {got} != manifest {entry.checksum}"
            )
    return unpack_views(buf, entry.tensors)
