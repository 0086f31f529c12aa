"""The manifest every sync carries: version, buckets, and each tensor's name, unit, dtype, shape, bytes.

It crosses the wire as JSON bytes (never pickle) and is parsed strictly: a missing or extra key, a
wrong type, an overlapping byte range or a name listed twice is refused before any weight is read.
Everything but the version and the checksums is the sync's *layout*; the manifest carries the
layout's digest, so later syncs of the same layout can refer to it instead (`layout.SameLayout`).
A *unit* is one source parameter: a weight together with its scales (FORMATS.md "a weight and its
scale(s) are one unit"); all tensors of a unit sit in one bucket.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from skyq.sync.errors import SyncRefused
from skyq.sync.wire_dtypes import dtype_from_name, nbytes_of

MANIFEST_FORMAT = "skyq-weight-sync/2"
"""Format tag of the sync messages (full manifest, same-layout message); a receiver refuses any other.
/2 added the layout digest and the same-layout message; checksums are unchanged from /1."""


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """Where one wire tensor lives inside its bucket."""

    name: str
    """Wire name, e.g. `model.layers.0.mlp.experts.1.up_proj.weight_scale_inv`."""
    unit: str
    """The source parameter this tensor was serialized from (its weight and scales share it)."""
    dtype: str
    """Wire dtype name (see `wire_dtypes.WIRE_DTYPES`)."""
    shape: tuple[int, ...]
    """Tensor shape."""
    offset: int
    """Byte offset inside the bucket."""
    nbytes: int
    """Byte length."""


@dataclass(frozen=True, slots=True)
class BucketEntry:
    """One bucket: a flat byte buffer holding whole units."""

    index: int
    nbytes: int
    checksum: str
    """`<algorithm>:<digest>` of the bucket bytes (see checksums.py)."""
    tensors: tuple[TensorEntry, ...]


@dataclass(frozen=True, slots=True)
class SyncManifest:
    """Everything the receiver needs to account for one sync."""

    version: int
    """Weight version this sync commits (strictly increasing)."""
    buckets: tuple[BucketEntry, ...]

    @property
    def total_bytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)

    @property
    def tensors(self) -> list[TensorEntry]:
        return [t for b in self.buckets for t in b.tensors]

    def validate(self) -> None:
        """Refuse an internally inconsistent manifest (whoever built it)."""
        if self.version < 1:
            raise SyncRefused(f"manifest version {self.version}: weight versions start at 1")
        seen_names: set[str] = set()
        unit_bucket: dict[str, int] = {}
        for i, bucket in enumerate(self.buckets):
            if bucket.index != i:
                raise SyncRefused(f"manifest bucket {i} is labelled {bucket.index}: buckets must be in order")
            end = 0
            for t in sorted(bucket.tensors, key=lambda e: e.offset):
                _validate_entry(t, bucket)
                if t.offset < end:
                    raise SyncRefused(f"manifest: `{t.name}` overlaps the previous tensor in bucket {i}")
                end = t.offset + t.nbytes
                if t.name in seen_names:
                    raise SyncRefused(f"manifest lists `{t.name}` twice")
                seen_names.add(t.name)
                if unit_bucket.setdefault(t.unit, i) != i:
                    raise SyncRefused(
                        f"manifest splits unit `{t.unit}` across buckets {unit_bucket[t.unit]} and {i}: "
                        "a weight and its scales must travel in the same bucket"
                    )

    def layout_digest(self) -> str:
        """`sha256:<hex>` of the layout: every bucket's size and every tensor's name, unit, dtype,
        shape, offset and bytes, in order (the version and the checksums left out)."""
        layout = [[b.index, b.nbytes, [_tensor_json(t) for t in b.tensors]] for b in self.buckets]
        return "sha256:" + hashlib.sha256(json.dumps(layout, separators=(",", ":")).encode()).hexdigest()

    def to_json_bytes(self, layout_digest: str | None = None) -> bytes:
        """The manifest as JSON; `layout_digest` is `self.layout_digest()`, when the caller has it."""
        payload = {
            "format": MANIFEST_FORMAT,
            "version": self.version,
            "layout": layout_digest or self.layout_digest(),
            "buckets": [
                {
                    "index": b.index,
                    "nbytes": b.nbytes,
                    "checksum": b.checksum,
                    "tensors": [_tensor_json(t) for t in b.tensors],
                }
                for b in self.buckets
            ],
        }
        return json.dumps(payload, separators=(",", ":")).encode()

    @classmethod
    def from_json_bytes(cls, raw: bytes) -> SyncManifest:
        """Parse and validate a manifest received from another process."""
        return cls.from_json(parse_message_json(raw, "manifest"))

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> SyncManifest:
        """Validate a parsed manifest, its layout digest included (`parse_message_json` checked the format)."""
        expect_keys(obj, {"format", "version", "layout", "buckets"}, "manifest")
        buckets = tuple(_parse_bucket(b) for b in expect_value(obj["buckets"], list, "manifest.buckets"))
        manifest = cls(version=expect_value(obj["version"], int, "manifest.version"), buckets=buckets)
        manifest.validate()
        digest = manifest.layout_digest()
        if obj["layout"] != digest:
            raise SyncRefused(
                f"manifest of version {manifest.version} says layout {obj['layout']!r}, its contents digest "
                f"to {digest!r} (skyq versions differ?)"
            )
        return manifest


def parse_message_json(raw: bytes, what: str) -> dict[str, Any]:
    """A sync message's JSON object, its format tag checked."""
    try:
        obj = json.loads(raw.decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SyncRefused(f"weight-sync {what} is not valid JSON: {exc}") from None
    if not isinstance(obj, dict) or "format" not in obj:
        raise SyncRefused(f"weight-sync {what} must be a JSON object with a `format` key")
    if obj["format"] != MANIFEST_FORMAT:
        raise SyncRefused(
            f"weight-sync {what} format {obj['format']!r}, expected {MANIFEST_FORMAT!r} (skyq versions differ?)"
        )
    return obj


def _tensor_json(t: TensorEntry) -> dict[str, Any]:
    return {
        "name": t.name,
        "unit": t.unit,
        "dtype": t.dtype,
        "shape": list(t.shape),
        "offset": t.offset,
        "nbytes": t.nbytes,
    }


def _validate_entry(t: TensorEntry, bucket: BucketEntry) -> None:
    expected = nbytes_of(dtype_from_name(t.dtype), t.shape)
    if t.nbytes != expected:
        raise SyncRefused(
            f"manifest: `{t.name}` says {t.nbytes} bytes, but {t.dtype}{list(t.shape)} is {expected}"
        )
    if t.offset < 0 or t.offset + t.nbytes > bucket.nbytes:
        raise SyncRefused(
            f"manifest: `{t.name}` at bytes [{t.offset}, {t.offset + t.nbytes}) lies outside "
            f"bucket {bucket.index} of {bucket.nbytes} bytes"
        )


def _parse_bucket(obj: Any) -> BucketEntry:
    expect_keys(obj, {"index", "nbytes", "checksum", "tensors"}, "manifest bucket")
    return BucketEntry(
        index=expect_value(obj["index"], int, "bucket.index"),
        nbytes=expect_value(obj["nbytes"], int, "bucket.nbytes"),
        checksum=expect_value(obj["checksum"], str, "bucket.checksum"),
        tensors=tuple(_parse_tensor(t) for t in expect_value(obj["tensors"], list, "bucket.tensors")),
    )


def _parse_tensor(obj: Any) -> TensorEntry:
    expect_keys(obj, {"name", "unit", "dtype", "shape", "offset", "nbytes"}, "manifest tensor")
    shape = expect_value(obj["shape"], list, "tensor.shape")
    if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise SyncRefused(f"manifest: `{obj['name']}` has shape {shape}; dims must be non-negative ints")
    return TensorEntry(
        name=expect_value(obj["name"], str, "tensor.name"),
        unit=expect_value(obj["unit"], str, "tensor.unit"),
        dtype=expect_value(obj["dtype"], str, "tensor.dtype"),
        shape=tuple(shape),
        offset=expect_value(obj["offset"], int, "tensor.offset"),
        nbytes=expect_value(obj["nbytes"], int, "tensor.nbytes"),
    )


def expect_keys(obj: Any, keys: set[str], what: str) -> None:
    if not isinstance(obj, dict) or set(obj) != keys:
        got = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
        raise SyncRefused(f"{what} must have exactly the keys {sorted(keys)}, got {got}")


def expect_value(value: Any, kind: type, what: str) -> Any:
    # bool is an int subclass in Python; a JSON `true` is never a valid count or offset.
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise SyncRefused(f"{what} must be a {kind.__name__}, got {value!r}")
    return value
