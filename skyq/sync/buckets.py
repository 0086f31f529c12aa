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

from skyq.sync.byte_runs import BytePieces, interleave, unpack_views
from skyq.sync.checksums import bucket_checksum, checksum_algorithm
from skyq.sync.errors import SyncRefused
from skyq.sync.manifest import BucketEntry, TensorEntry
from skyq.sync.wire_dtypes import dtype_name

ALIGN_BYTES = 16
"""Tensor offsets inside a bucket are multiples of this, so every dtype can be viewed in place."""


@dataclass(frozen=True, slots=True)
class WireUnit:
    """One source parameter as it crosses the wire: wire name -> tensor (its weight and scales)."""

    source: str
    tensors: dict[str, Tensor]

    @property
    def packed_bytes(self) -> int:
        """Bytes this unit takes in a bucket, alignment padding included."""
        return sum(_aligned(t.numel() * t.element_size()) for t in self.tensors.values())


def _aligned(n: int) -> int:
    return (n + ALIGN_BYTES - 1) // ALIGN_BYTES * ALIGN_BYTES


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


def pack_bucket(index: int, units: Sequence[WireUnit]) -> tuple[Tensor, BucketEntry]:
    """Lay the units' bytes into one flat uint8 buffer and describe where each tensor lies.

    Tensors go in `interleave` order (every unit's weight, then every unit's scales), so views of
    one batched output are one byte range; the buffer is one `torch.cat` of those ranges and the
    zero padding between tensors."""
    lists = [list(unit.tensors.items()) for unit in units]
    device = next((ts[0][1].device for ts in lists if ts), torch.device("cpu"))
    pieces = BytePieces(device)
    entries: list[TensorEntry] = []
    offset = 0
    for u, k in interleave(lists):
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
        pieces.pad_to(offset)
        pieces.add(t)
        offset += _aligned(nbytes)
    # Padding is zeros, so the bytes (and hence the checksum) are deterministic.
    buf = pieces.cat()
    return buf, BucketEntry(
        index=index, nbytes=buf.numel(), checksum=bucket_checksum(buf), tensors=tuple(entries)
    )


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
