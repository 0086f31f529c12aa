"""A sync's layout, kept between syncs so a repeat sync costs per bucket, not per tensor.

The layout is the manifest minus the version and the checksums: every bucket's size and every
tensor's name, unit, dtype, shape and place. It does not change while the model and the precision
do not, so the sender sends it in full once; after the engine committed that sync, a sync whose
units have the same names, dtypes and shapes in the same order sends only a `SameLayout` message
(version, "the layout of version N, digest D", the bucket checksums). The receiver uses the layout
it committed with version N only if N and D match what it holds, and refuses the sync otherwise;
either side drops its cached layout after a failed sync, so the next one goes in full.

Both sides also keep what they derived from the layout: the sender the byte ranges it copies
(`Copy`s: a stack's members at once), the receiver the runs it views with one `unbind`, and both the
byte spans they value-check and the chunk table (`scan.ScanPlan`) that checksums and value-checks
every bucket in one pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from skyq.sync.buckets import WireStack, WireUnit, bucket_entries, plan_buckets
from skyq.sync.byte_runs import Copy, Run, find_runs, gather, plan_copies
from skyq.sync.checksums import checksum_algorithm
from skyq.sync.errors import SyncRefused
from skyq.sync.fill import FillPlan
from skyq.sync.manifest import MANIFEST_FORMAT, BucketEntry, SyncManifest, expect_keys, expect_value
from skyq.sync.scan import ScanPlan
from skyq.sync.values import Span, find_spans
from skyq.sync.wire_dtypes import as_bytes
from skyq.sync.wire_state import WireState, wire_index

WireItem = WireUnit | WireStack
"""What the sender serialized from one weight item: a unit, or a stack of them held whole."""

Signature = tuple[tuple[object, ...], ...]
"""Per item, in order: a unit's (source, ((wire name, dtype, shape), ...)), a stack's (sources,
((member names, dtype, whole shape), ...)). Equal signatures mean the same wire layout and the
same packing plan."""


def item_signature(items: Sequence[WireItem]) -> Signature:
    """The items' names, dtypes and shapes, in order: attribute reads and tuples of the names the
    items already hold (no kernel, no copy, no per-member work for a stack)."""
    return tuple(
        (
            item.sources,
            tuple(zip(item.names, (t.dtype for t in item.tensors), (t.shape for t in item.tensors))),
        )
        if isinstance(item, WireStack)
        else (item.source, tuple((name, t.dtype, t.shape) for name, t in item.tensors.items()))
        for item in items
    )


def expand_units(items: Sequence[WireItem]) -> tuple[list[WireUnit], list[tuple[int, int]]]:
    """Every unit of `items` in order, and the (item, member) each came from."""
    units: list[WireUnit] = []
    origins: list[tuple[int, int]] = []
    for i, item in enumerate(items):
        new = item.units() if isinstance(item, WireStack) else [item]
        units.extend(new)
        origins.extend((i, e) for e in range(len(new)))
    return units, origins


@dataclass(frozen=True, slots=True)
class SameLayout:
    """A sync that reuses the layout of an earlier one: only the version and the checksums travel."""

    version: int
    same_layout_as: int
    """The version whose full manifest carried the layout."""
    layout: str
    """That layout's digest (`SyncManifest.layout_digest`)."""
    checksums: tuple[str, ...]
    """One per bucket, in order."""

    def to_json(self) -> dict[str, Any]:
        return {
            "format": MANIFEST_FORMAT,
            "version": self.version,
            "same_layout_as": self.same_layout_as,
            "layout": self.layout,
            "checksums": list(self.checksums),
        }

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> SameLayout:
        expect_keys(
            obj, {"format", "version", "same_layout_as", "layout", "checksums"}, "same-layout message"
        )
        checksums = tuple(
            expect_value(c, str, "checksum") for c in expect_value(obj["checksums"], list, "checksums")
        )
        for checksum in checksums:
            checksum_algorithm(checksum)
        return cls(
            version=expect_value(obj["version"], int, "version"),
            same_layout_as=expect_value(obj["same_layout_as"], int, "same_layout_as"),
            layout=expect_value(obj["layout"], str, "layout"),
            checksums=checksums,
        )


@dataclass(frozen=True, slots=True)
class SenderLayout:
    """The sender's side of a layout: its manifest entries and how to pack items into buckets."""

    version: int
    """The version whose full manifest carries this layout."""
    signature: Signature
    buckets: tuple[BucketEntry, ...]
    """Bucket entries with empty checksums."""
    digest: str
    copies: tuple[tuple[Copy, ...], ...]
    """Per bucket, the byte ranges that lay it (`byte_runs.plan_copies`)."""
    spans: tuple[tuple[Span, ...], ...]
    """Per bucket, the byte spans of checked dtypes: the sender value-checks what it packed."""
    scan: ScanPlan
    num_tensors: int
    total_bytes: int
    fill: FillPlan | None = None
    """Where each item goes in one flat buffer of the buckets (`fill.FillPlan`); None when the
    layout holds a dtype that cannot be viewed in place (bool)."""
    sources: SourceSignature | None = None
    """The signature of the trainer's items the layout was built from (`source_signature`), when
    known: a later sync with the same one is filled in place (`fill`)."""
    origins: tuple[int, ...] = ()
    """Per source item, the index of its first wire item (and a last entry: the number of items)."""

    @classmethod
    def build(
        cls,
        items: Sequence[WireItem],
        *,
        bucket_bytes: int,
        version: int,
        sources: Sequence[tuple[Any, Tensor]] | None = None,
    ) -> SenderLayout:
        """Plan buckets for the units of `items` and lay them out (`buckets.bucket_entries`).
        `sources`: the (name or names, tensor) items `items` were serialized from, in order."""
        units, origins = expand_units(items)
        stacked = [isinstance(item, WireStack) for item in items]
        buckets, copies = [], []
        start = 0
        for index, group in enumerate(plan_buckets(units, bucket_bytes)):
            entries, order, nbytes = bucket_entries(group)
            buckets.append(BucketEntry(index=index, nbytes=nbytes, checksum="", tensors=entries))
            members = [(*origins[start + u], k) for u, k in order]
            copies.append(
                plan_copies(
                    [e.offset for e in entries],
                    [e.nbytes for e in entries],
                    [(item, k, member) for item, member, k in members],
                    stacked,
                )
            )
            start += len(group)
        manifest = SyncManifest(version=version, buckets=tuple(buckets))
        spans = tuple(find_spans(find_runs(b.tensors)) for b in buckets)
        signature = item_signature(items)
        viewable = all(t.dtype != torch.bool for item in items for t in _tensors(item))
        origins = _origins(sources, items) if sources is not None else None
        return cls(
            version=version,
            signature=signature,
            buckets=manifest.buckets,
            digest=manifest.layout_digest(),
            copies=tuple(copies),
            spans=spans,
            scan=ScanPlan.of([b.nbytes for b in buckets], spans),
            num_tensors=sum(len(b.tensors) for b in buckets),
            total_bytes=manifest.total_bytes,
            fill=FillPlan([b.nbytes for b in buckets], copies, len(items)) if viewable else None,
            sources=source_signature(sources) if origins is not None else None,
            origins=origins or (),
        )

    def item_specs(self, item: int) -> tuple[bool, list[tuple[torch.dtype, tuple[int, ...]]]]:
        """(whether item `item` is a stack, its (dtype, shape) per wire position: a stack's whole shape)."""
        names, entries = self.signature[item]
        return not isinstance(names, str), [(dtype, tuple(shape)) for _, dtype, shape in entries]

    def pack(self, items: Sequence[WireItem]) -> list[Tensor]:
        """The buckets' bytes for `items` (whose signature must be this layout's)."""
        bufs = []
        for bucket, copies in zip(self.buckets, self.copies):
            sources = [_source(items[c.item], c) for c in copies]
            device = sources[0].device if sources else torch.device("cpu")
            bufs.append(gather(sources, copies, bucket.nbytes, device))
        return bufs

    def wire(self, bufs: Sequence[Tensor]) -> WireState:
        """Every tensor of the packed buckets `bufs`, by name (views; for the exact value check of a
        sync whose scan raised a flag)."""
        runs = tuple(find_runs(b.tensors) for b in self.buckets)
        return WireState(frames=bufs, runs=runs, index=wire_index(runs), layout=self.digest)

    def manifest(self, version: int, checksums: Sequence[str]) -> SyncManifest:
        buckets = tuple(
            BucketEntry(index=b.index, nbytes=b.nbytes, checksum=c, tensors=b.tensors)
            for b, c in zip(self.buckets, checksums, strict=True)
        )
        return SyncManifest(version=version, buckets=buckets)


SourceSignature = tuple[tuple[object, ...], ...]
"""Per trainer item: (name or names, shape, dtype, device)."""


def source_signature(sources: Sequence[tuple[Any, Tensor]]) -> SourceSignature:
    """The trainer's items' names, shapes, dtypes and devices, in order: with the same serializer,
    equal signatures serialize to the same wire layout."""
    return tuple(
        (name if isinstance(name, str) else tuple(name), t.shape, t.dtype, t.device) for name, t in sources
    )


def _origins(sources: Sequence[tuple[Any, Tensor]], items: Sequence[WireItem]) -> tuple[int, ...] | None:
    """Per source, the index of its first wire item, then len(items): a name gives one unit, a stack
    one `WireStack` or one unit per member. None when `items` do not follow `sources` so."""
    out, pos = [], 0
    for name, _ in sources:
        out.append(pos)
        if pos >= len(items):
            return None
        item = items[pos]
        if isinstance(name, str):
            ok, pos = isinstance(item, WireUnit) and item.source == name, pos + 1
        elif isinstance(item, WireStack):
            ok, pos = item.sources == tuple(name), pos + 1
        else:
            members = items[pos : pos + len(name)]
            ok = len(members) == len(name) and all(
                isinstance(u, WireUnit) and u.source == n for u, n in zip(members, name)
            )
            pos += len(name)
        if not ok:
            return None
    return (*out, pos) if pos == len(items) else None


def _tensors(item: WireItem) -> Sequence[Tensor]:
    return item.tensors if isinstance(item, WireStack) else list(item.tensors.values())


def _source(item: WireItem, copy: Copy) -> Tensor:
    """The bytes of the members a copy takes from its item (a view unless they are strided)."""
    if isinstance(item, WireStack):
        return as_bytes(item.tensors[copy.position][copy.first : copy.first + copy.count])
    return as_bytes(list(item.tensors.values())[copy.position])


@dataclass(frozen=True, slots=True)
class ReceiverLayout:
    """The receiver's side of a layout: bucket sizes, runs to view, spans to value-check."""

    version: int
    digest: str
    bucket_nbytes: tuple[int, ...]
    runs: tuple[tuple[Run, ...], ...]
    spans: tuple[tuple[Span, ...], ...]
    scan: ScanPlan
    num_tensors: int
    total_bytes: int
    index: dict[str, tuple[int, int, int]] = field(compare=False, hash=False, repr=False)
    """Name -> (bucket, run, member): where `unpack` finds each tensor (`wire_state.wire_index`)."""

    @classmethod
    def of(cls, manifest: SyncManifest, digest: str) -> ReceiverLayout:
        """The layout of a validated manifest, whose `layout_digest()` is `digest`."""
        runs = tuple(find_runs(b.tensors) for b in manifest.buckets)
        spans = tuple(find_spans(r) for r in runs)
        return cls(
            version=manifest.version,
            digest=digest,
            bucket_nbytes=tuple(b.nbytes for b in manifest.buckets),
            runs=runs,
            spans=spans,
            scan=ScanPlan.of([b.nbytes for b in manifest.buckets], spans),
            num_tensors=sum(len(b.tensors) for b in manifest.buckets),
            total_bytes=manifest.total_bytes,
            index=wire_index(runs),
        )

    def check_same(self, message: SameLayout) -> None:
        """Refuse a same-layout message that names a layout other than this one."""
        if message.same_layout_as != self.version or message.layout != self.digest:
            raise SyncRefused(
                f"weight version {message.version} refers to the layout of version {message.same_layout_as} "
                f"(digest {message.layout[:23]}), but the engine holds the layout of version {self.version} "
                f"(digest {self.digest[:23]}); nothing was committed, the next sync sends a full manifest"
            )
        if len(message.checksums) != len(self.bucket_nbytes):
            raise SyncRefused(
                f"weight version {message.version} carries {len(message.checksums)} checksums for a "
                f"layout of {len(self.bucket_nbytes)} buckets"
            )

    def unpack(self, frames: Sequence[Tensor]) -> WireState:
        """Every tensor as a view into its bucket's frame, in byte order: a `WireState`, which makes
        the views on first use (a commit can also copy it as integer words, making none)."""
        if len(frames) != len(self.runs):
            raise SyncRefused(f"{len(frames)} frames for a layout of {len(self.runs)} buckets")
        return WireState(frames=frames, runs=self.runs, index=self.index, layout=self.digest)


def no_layout_refusal(message: SameLayout) -> SyncRefused:
    """The refusal of a same-layout message by a receiver that holds no layout."""
    return SyncRefused(
        f"weight version {message.version} refers to the layout of version {message.same_layout_as} "
        f"(digest {message.layout[:23]}), but the engine holds no layout (it committed no full manifest "
        "on this receiver); nothing was committed, the next sync sends a full manifest"
    )
