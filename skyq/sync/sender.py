"""Trainer side of a weight sync: serialize -> bucket -> send -> wait for the engine's accounting.

The whole sync is serialized and checked before the first byte leaves, so a non-finite weight is
refused with nothing sent: the quantizer kernels flag a non-finite input, and one pass over the packed
buckets (`scan.PendingScan`, with the checksums) flags every non-finite float and e4m3 NaN code of
what goes out; only a flag pays for the exact per-tensor check that names the first bad tensor. With
a plan serializer every item is serialized by one call (`serialize_many`: one grouped quantizer
launch for all fp8 matrices and stacks of the sync). A repeat sync of an unchanged layout sends a short `SameLayout` message
in place of the full manifest (see layout.py). The sender waits for two acknowledgements: the engine accepts the
manifest (version and names), then reports what it committed; a sync counts as done only when the
committed tensor and byte counts equal the manifest's.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import Tensor

from skyq.quant.errors import QuantizationError, check_finite
from skyq.quant.kernels.dispatch import (
    check_finite_deferred,
    check_finite_stack_deferred,
    deferred_finite_checks,
)
from skyq.sync.buckets import WireStack, WireUnit
from skyq.sync.channel import Channel, give_frame, recv_json, send_bytes, send_json
from skyq.sync.errors import SyncError, SyncRefused
from skyq.sync.fill import copy_into
from skyq.sync.layout import (
    SameLayout,
    SenderLayout,
    WireItem,
    expand_units,
    item_signature,
    source_signature,
)
from skyq.sync.scan import PendingScan
from skyq.sync.values import FLOATS, check_received_values

Serializer = Callable[[str, Tensor], dict[str, Tensor]]
"""`QuantizationStrategy.serialize`: one source tensor -> its wire tensors (weight and scales).
A serializer may also have `serialize_stack_tensors(names, stack)` (whole wire tensors per wire
position, see `QuantizationStrategy.serialize_stack_tensors`) or `serialize_stack(names, stack) ->
list[dict]` (see `plan_wire`), which stacked items then use: one quantizer call per stack instead of
one per tensor."""

WeightItem = tuple[str, Tensor] | tuple[Sequence[str], Tensor]
"""What the trainer's weight iterator yields: `(name, tensor)`, or `(names, stack)` for a stack
[E, ...] of same-shaped tensors held together (e.g. one projection's routed experts), where
`stack[i]` is the tensor named `names[i]`. Each stacked tensor is still its own unit on the wire."""


@dataclass(frozen=True, slots=True)
class SyncStats:
    """What one sync moved and where its time went (seconds)."""

    version: int
    num_tensors: int
    num_buckets: int
    bytes: int
    full_manifest: bool
    """True when the sync sent its full manifest, False when it reused the layout of an earlier one."""
    in_place: bool
    """True when the buckets were filled in place (`_fill`: quantized straight into them), False
    when the wire tensors were made first and packed."""
    gather_s: float
    """Producing the trainer's full-precision tensors (the trainer's weight iterator)."""
    quantize_s: float
    """Finite checks and the strategy's serialize()."""
    transfer_s: float
    """Packing, checksums, and sending until the engine acknowledged every bucket, minus load_s."""
    load_s: float
    """Engine side: verifying, unpacking and committing (reported by the engine)."""
    total_s: float

    def as_metrics(self) -> dict[str, float]:
        return {f"sync/{key}": float(value) for key, value in asdict(self).items()}


def serialize_unit(
    name: str, tensor: Tensor, serialize: Serializer, version: int, *, check: bool = True
) -> WireUnit:
    """One source tensor through the strategy, refused (naming it) if it is not finite.
    `check=False` leaves the input check to the caller (`WeightSender` checks what it packed)."""
    try:
        if check:
            check_finite_deferred(tensor, name)
        wire = serialize(name, tensor)
    except QuantizationError as exc:
        raise SyncRefused(f"weight sync of version {version} refused before sending anything: {exc}") from exc
    return _unit(name, wire)


def serialize_stack_item(
    names: Sequence[str], stack: Tensor, serialize: Serializer, version: int, *, check: bool = True
) -> WireStack | list[WireUnit]:
    """A stack [E, ...] of source tensors (`stack[i]` is `names[i]`) through the strategy: one finite
    check and, when the serializer has `serialize_stack_tensors`, one quantizer call for all of them,
    kept as whole tensors (a `WireStack`). The wire tensors are bit-identical to serializing each
    `stack[i]` on its own."""
    if stack.ndim < 1 or stack.shape[0] != len(names) or not names:
        raise SyncError(
            f"a stacked weight item has {len(names)} names for a tensor of shape {tuple(stack.shape)}"
        )
    try:
        if check:
            _check_stack_finite(stack, names)
        whole = getattr(serialize, "serialize_stack_tensors", None)
        columns = whole(names, stack) if whole is not None else None
        if columns is not None:
            return _wire_stack(names, columns)
        batched = getattr(serialize, "serialize_stack", None)
        if batched is not None:
            wires = batched(names, stack)
        else:
            wires = [serialize(name, stack[i]) for i, name in enumerate(names)]
    except QuantizationError as exc:
        raise SyncRefused(f"weight sync of version {version} refused before sending anything: {exc}") from exc
    if len(wires) != len(names):
        raise SyncError(f"serializing a stack of {len(names)} tensors produced {len(wires)} wire units")
    return [_unit(name, wire) for name, wire in zip(names, wires)]


def _check_stack_finite(stack: Tensor, names: Sequence[str]) -> None:
    """`check_finite_stack_deferred`; on the CPU (where it checks member by member) after one sum
    over the whole stack, which only a non-finite (or overflowing) stack fails."""
    if stack.is_cuda or not (
        stack.dtype in FLOATS and stack.numel() and bool(torch.isfinite(stack.sum(dtype=torch.float32)))
    ):
        check_finite_stack_deferred(stack, names)


def _wire_stack(names: Sequence[str], columns: Sequence[tuple[tuple[str, ...], Tensor]]) -> WireStack:
    n = len(names)
    if not columns or any(len(member_names) != n or t.shape[0] != n for member_names, t in columns):
        raise SyncError(
            f"serializing a stack of {n} tensors produced wire tensors of shapes "
            f"{[tuple(t.shape) for _, t in columns]}"
        )
    return WireStack(
        sources=tuple(names),
        names=tuple(member_names for member_names, _ in columns),
        tensors=tuple(t for _, t in columns),
    )


def _unit(name: str, wire: dict[str, Tensor]) -> WireUnit:
    if not wire:
        raise SyncError(
            f"serializing `{name}` produced no wire tensors; the strategy must return at least one"
        )
    return WireUnit(source=name, tensors=dict(wire))


def build_units(
    weights: Iterable[WeightItem], serialize: Serializer, version: int
) -> tuple[list[WireUnit], float, float]:
    """Serialize every source tensor; returns (units, gather seconds, quantize seconds).

    On CUDA the finite checks of the inputs and of the quantizer kernels are read together at the
    end (`deferred_finite_checks`: one host sync, not one per tensor); the first bad tensor in
    order is still refused by name before anything is sent."""
    items, gather_s, quantize_s = build_items(weights, serialize, version)
    check_unique_names(items)
    return expand_units(items)[0], gather_s, quantize_s


def build_items(
    weights: Iterable[WeightItem], serialize: Serializer, version: int
) -> tuple[list[WireItem], float, float]:
    """`build_units` with each stacked item kept whole (a `WireStack`) and no name check: a sync
    checks names only when its layout is new (a cached layout's names were checked)."""
    try:
        with deferred_finite_checks():
            return _build_items(weights, serialize, version)
    except QuantizationError as exc:
        raise SyncRefused(f"weight sync of version {version} refused before sending anything: {exc}") from exc


def _build_items(
    weights: Iterable[WeightItem],
    serialize: Serializer,
    version: int,
    *,
    sources: list[WeightItem] | None = None,
) -> tuple[list[WireItem], float, float]:
    """`sources`: when given, the input checks are left out and every item is appended to it
    (for the caller's value check of the packed buckets and its exact check on failure)."""
    check = sources is None
    many = getattr(serialize, "serialize_many", None)
    if not check and many is not None:
        return _build_items_batched(weights, serialize, many, version, sources)  # type: ignore[arg-type]
    items: list[WireItem] = []
    gather_s = quantize_s = 0.0
    iterator = iter(weights)
    while True:
        start = time.perf_counter()
        item = next(iterator, None)
        gather_s += time.perf_counter() - start
        if item is None:
            break
        name, tensor = item
        if sources is not None:
            sources.append(item)
        start = time.perf_counter()
        if isinstance(name, str):
            items.append(serialize_unit(name, tensor, serialize, version, check=check))
        else:
            new = serialize_stack_item(tuple(name), tensor, serialize, version, check=check)
            if isinstance(new, WireStack):
                items.append(new)
            else:
                items.extend(new)
        quantize_s += time.perf_counter() - start
    if not items:
        raise SyncRefused(f"weight sync of version {version}: the trainer produced no weights to send")
    return items, gather_s, quantize_s


BATCH_BYTES = 2 << 30
"""Source bytes serialized per `serialize_many` call at most: the bound on one grouped quantizer
call's inputs and outputs in flight."""


def _build_items_batched(
    weights: Iterable[WeightItem],
    serialize: Serializer,
    many: Callable[[list[tuple[Any, Tensor]]], list[Any]],
    version: int,
    sources: list[WeightItem],
) -> tuple[list[WireItem], float, float]:
    """`_build_items` without input checks for a serializer with `serialize_many`: the items
    serialized a batch (up to `BATCH_BYTES` of sources) per call, so the format batches its quantizer
    launches; stacks it leaves (None) go member by member."""
    items: list[WireItem] = []
    gather_s = quantize_s = 0.0
    batch: list[tuple[Any, Tensor]] = []
    batch_bytes = 0
    iterator = iter(weights)
    while True:
        start = time.perf_counter()
        item = next(iterator, None)
        gather_s += time.perf_counter() - start
        if item is not None:
            key, tensor = _source_item(item)
            sources.append((key, tensor))
            batch.append((key, tensor))
            batch_bytes += tensor.numel() * tensor.element_size()
        if batch and (item is None or batch_bytes >= BATCH_BYTES):
            start = time.perf_counter()
            items.extend(_serialize_batch(batch, serialize, many, version))
            quantize_s += time.perf_counter() - start
            batch, batch_bytes = [], 0
        if item is None:
            break
    if not items:
        raise SyncRefused(f"weight sync of version {version}: the trainer produced no weights to send")
    return items, gather_s, quantize_s


def _serialize_batch(
    batch: list[tuple[Any, Tensor]],
    serialize: Serializer,
    many: Callable[[list[tuple[Any, Tensor]]], list[Any]],
    version: int,
) -> list[WireItem]:
    try:
        wires = many(batch)
    except QuantizationError as exc:
        raise SyncRefused(f"weight sync of version {version} refused before sending anything: {exc}") from exc
    if len(wires) != len(batch):
        raise SyncError(f"serializing {len(batch)} weight items produced {len(wires)} results")
    items: list[WireItem] = []
    for (name, tensor), wire in zip(batch, wires):
        if isinstance(name, str):
            items.append(_unit(name, wire))
        elif wire is not None:
            items.append(_wire_stack(name, wire))
        else:
            new = serialize_stack_item(name, tensor, serialize, version, check=False)
            items.extend([new] if isinstance(new, WireStack) else new)
    return items


def _collect(weights: Iterable[WeightItem]) -> tuple[list[tuple[Any, Tensor]], float]:
    """The trainer's items as a list of (name or tuple of names, tensor), stacks checked; and the
    seconds the iterator took."""
    start = time.perf_counter()
    out = [_source_item(item) for item in weights]
    return out, time.perf_counter() - start


def _source_item(item: WeightItem) -> tuple[Any, Tensor]:
    """(name, tensor), or (tuple of names, stack) checked to hold one tensor per name."""
    name, tensor = item
    key = name if isinstance(name, str) else tuple(name)
    if not isinstance(key, str) and (tensor.ndim < 1 or tensor.shape[0] != len(key) or not key):
        raise SyncError(
            f"a stacked weight item has {len(key)} names for a tensor of shape {tuple(tensor.shape)}"
        )
    return key, tensor


def _fill(
    layout: SenderLayout, sources: list[tuple[Any, Tensor]], serialize: Serializer, version: int
) -> list[Tensor] | None:
    """The buckets of `layout` for `sources` (whose `source_signature` is the layout's), written in
    place (`fill.FillPlan`): the serializer quantizes what it can straight into them
    (`serialize_many_into`) and the wire tensors of the rest are copied there. None, with nothing
    kept, when the rest do not serialize to the layout's items (the caller then serializes all)."""
    plan, origins = layout.fill, layout.origins
    assert plan is not None and len(origins) == len(sources) + 1, (len(origins), len(sources))
    devices = {t.device for _, t in sources}
    if len(devices) != 1:
        return None
    bufs = plan.allocate(devices.pop())
    places: dict[int, list[tuple[int, int, tuple[Tensor, ...]]]] = {}

    def destinations(j: int) -> list[tuple[int, int, tuple[Tensor, ...]]]:
        if j not in places:
            stacked, specs = layout.item_specs(j)
            places[j] = plan.destinations(bufs, j, specs, stacked)
        return places[j]

    single = [i for i in range(len(sources)) if origins[i + 1] - origins[i] == 1]
    into = getattr(serialize, "serialize_many_into", None)
    done: set[int] = set()
    if into is not None and single:
        written = into([sources[i] for i in single], [destinations(origins[i]) for i in single])
        done = {i for i, ok in zip(single, written, strict=True) if ok}
    rest = [i for i in range(len(sources)) if i not in done]
    if rest:
        items = _build_items(iter([sources[i] for i in rest]), serialize, version, sources=[])[0]
        pairs: list[tuple[Tensor, Tensor]] = []
        pos = 0
        for i in rest:
            j0, j1 = origins[i], origins[i + 1]
            got = items[pos : pos + j1 - j0]
            pos += j1 - j0
            if item_signature(got) != layout.signature[j0:j1]:
                return None
            for j, item in zip(range(j0, j1), got):
                tensors = item.tensors if isinstance(item, WireStack) else list(item.tensors.values())
                stacked = isinstance(item, WireStack)
                for first, count, views in destinations(j):
                    pairs.extend(
                        (view, t[first : first + count] if stacked else t) for view, t in zip(views, tensors)
                    )
        if pos != len(items):
            return None
        copy_into(pairs)
    return bufs


def first_non_finite(
    sources: Sequence[WeightItem], items: Sequence[WireItem], wire: Mapping[str, Tensor] | None = None
) -> QuantizationError | None:
    """The error naming the first non-finite source tensor (stack members one by one), in order;
    else the first non-finite float or e4m3 NaN code among the wire tensors (a cast that
    overflowed): those of `items`, then those of `wire` (the buckets of a sync filled in place);
    None when every value is good. Only a failed check pays for this exact pass."""
    try:
        for name, tensor in sources:
            if not tensor.is_floating_point():
                continue
            if isinstance(name, str):
                check_finite(tensor, name)
            else:
                for i, member in enumerate(name):
                    check_finite(tensor[i], member)
        for item in items:
            if isinstance(item, WireStack):
                pairs = (
                    (member, t[i])
                    for names, t in zip(item.names, item.tensors)
                    for i, member in enumerate(names)
                )
            else:
                pairs = iter(item.tensors.items())
            check_received_values(dict(pairs))
        if wire is not None:
            check_received_values(wire)
    except QuantizationError as exc:
        return exc
    except SyncRefused as exc:  # check_received_values wraps the QuantizationError
        return exc.__cause__ if isinstance(exc.__cause__, QuantizationError) else None
    return None


def check_unique_names(items: Sequence[WireItem]) -> None:
    """Refuse two units that produce the same wire name."""
    seen: dict[str, str] = {}
    for item in items:
        if isinstance(item, WireStack):
            pairs = ((name, source) for names in item.names for name, source in zip(names, item.sources))
        else:
            pairs = ((name, item.source) for name in item.tensors)
        for wire_name, source in pairs:
            if wire_name in seen:
                raise SyncError(
                    f"wire name `{wire_name}` produced by both `{seen[wire_name]}` and `{source}`"
                )
            seen[wire_name] = source


def _refusal(version: int, problem: Exception) -> SyncRefused:
    return SyncRefused(f"weight sync of version {version} refused before sending anything: {problem}")


class WeightSender:
    """Sends full weight syncs over one channel.

    Keep one sender per channel: after a sync the engine committed, the sender remembers its layout
    (`layout.SenderLayout`), and a later sync with the same tensor names, dtypes and shapes sends a
    `SameLayout` message instead of the full manifest and packs its buckets from the cached plan."""

    def __init__(self, channel: Channel, *, serialize: Serializer, bucket_bytes: int) -> None:
        self._channel = channel
        self._serialize = serialize
        self._bucket_bytes = bucket_bytes
        self._layout: SenderLayout | None = None
        """The layout the engine committed with the last successful sync, if any."""

    def sync(self, weights: Iterable[WeightItem], version: int) -> SyncStats:
        """Send `weights` (HF name, full-precision tensor; or names and a stack of them) as weight
        version `version`.

        A sync of the same items (names, shapes, dtypes, devices) as the last committed one is
        filled in place (`fill`): the layout is known before anything is serialized, so the
        buckets are allocated first and the quantizers write into them directly; any other sync
        is serialized, laid out and packed."""
        start = time.perf_counter()
        sources: list[WeightItem] = []
        items: list[WireItem] = []
        bufs: list[Tensor] | None = None
        filled = False
        try:
            with deferred_finite_checks():
                # No separate input checks: the quantizer kernels flag non-finite inputs (read as the
                # scope closes) and the scan below checks every float / e4m3 byte that was packed.
                cached = self._layout
                gather_s = quantize_s = 0.0
                if cached is not None and cached.fill is not None and cached.sources is not None:
                    collected, gather_s = _collect(weights)
                    weights = collected  # the normal path below takes them if the fill does not
                    if source_signature(collected) == cached.sources:
                        begin = time.perf_counter()
                        sources.extend(collected)  # named by the refusal of a non-finite input
                        bufs = _fill(cached, collected, self._serialize, version)
                        quantize_s = time.perf_counter() - begin
                        if bufs is None:
                            sources.clear()
                if bufs is not None:
                    layout, full, filled = cached, False, True
                    transfer_start = time.perf_counter()
                else:
                    items, more_gather_s, quantize_s = _build_items(
                        weights, self._serialize, version, sources=sources
                    )
                    gather_s += more_gather_s
                    transfer_start = time.perf_counter()
                    full = cached is None or cached.signature != item_signature(items)
                    if full:
                        check_unique_names(items)
                        layout = SenderLayout.build(
                            items, bucket_bytes=self._bucket_bytes, version=version, sources=sources
                        )
                    else:
                        layout = cached
                    bufs = layout.pack(items)
                # Packing / filling, checksums and value flags are queued on the device before the
                # kernels' flags are read: leaving the scope waits once for all of it; nothing is sent
                # before.
                scan = PendingScan(bufs, layout.spans, layout.scan)
        except QuantizationError as exc:
            raise _refusal(version, first_non_finite(sources, items) or exc) from exc
        except SyncRefused as exc:
            if isinstance(exc.__cause__, QuantizationError):  # a quantizer refused an input at once
                raise _refusal(version, first_non_finite(sources, []) or exc.__cause__) from exc
            raise
        checksums, bad = scan.read()
        if bad:
            problem = first_non_finite(sources, items, layout.wire(bufs) if filled else None)
            if problem is not None:  # else a false alarm: a finite value above 2^127
                raise _refusal(version, problem)
        self._layout = None  # set again only once the engine committed
        if full:
            manifest = layout.manifest(version, checksums)
            manifest.validate()
            send_bytes(self._channel, manifest.to_json_bytes(layout.digest))
        else:
            send_json(
                self._channel, SameLayout(version, layout.version, layout.digest, tuple(checksums)).to_json()
            )
        self._expect_ack(
            recv_json(self._channel, f"engine's answer to manifest v{version}"), "manifest", version
        )
        for buf in bufs:  # made for this sync and never written again: handed over, not copied
            give_frame(self._channel, buf)
        ack = recv_json(self._channel, f"engine's commit of v{version}")
        self._expect_ack(ack, "commit", version)
        if ack["num_tensors"] != layout.num_tensors or ack["bytes"] != layout.total_bytes:
            raise SyncError(
                f"weight version {version}: the engine committed {ack['num_tensors']} tensors / {ack['bytes']} "
                f"bytes but the manifest holds {layout.num_tensors} / {layout.total_bytes}"
            )
        self._layout = layout
        end = time.perf_counter()
        load_s = float(ack["load_s"])
        return SyncStats(
            version=version,
            num_tensors=layout.num_tensors,
            num_buckets=len(bufs),
            bytes=layout.total_bytes,
            full_manifest=full,
            in_place=filled,
            gather_s=gather_s,
            quantize_s=quantize_s,
            transfer_s=max(end - transfer_start - load_s, 0.0),
            load_s=load_s,
            total_s=end - start,
        )

    @staticmethod
    def _expect_ack(ack: dict[str, Any], stage: str, version: int) -> None:
        keys = {"stage", "ok", "version", "error", "num_tensors", "bytes", "load_s"}
        if set(ack) != keys or ack["stage"] != stage:
            raise SyncError(
                f"weight version {version}: malformed {stage} acknowledgement from the engine: {ack}"
            )
        if ack["ok"] is not True:
            raise SyncRefused(
                f"the engine refused weight version {version} at the {stage} stage: {ack['error']}"
            )
        if ack["version"] != version:
            raise SyncError(
                f"weight version {version}: the engine acknowledged version {ack['version']} instead"
            )
