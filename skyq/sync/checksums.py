"""Bucket checksums: blake2b for buffers in host memory, a device-side weighted sum for GPU buffers.

The checksum string names its algorithm (`blake2b-128:<hex>`, `wsum64:<hex>`), and the receiver
recomputes whichever the manifest names, on whatever device its buffer is on. blake2b needs the
bytes on the host, which for a GPU bucket would mean a device-to-host copy per bucket on the hot
path of every sync; `wsum64` is computed where the bytes are.

wsum64 = (length, sum b_i, sum b_i * w_i) over the bytes b_i, with w_i = i mod 65521 + 1, exact
(per-chunk partial sums stay below 2^48 in int64; chunks combine in Python integers), so it is the
same number on CPU and GPU and in any reduction order. It detects every single-bit flip, truncation,
zeroed or shifted ranges; unlike blake2b it is not collision-resistant (two bytes exactly 65521
apart swapped go unnoticed) — it guards against transport and bookkeeping faults, not adversaries.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch
from torch import Tensor

from skyq.sync.errors import SyncRefused

BLAKE2B = "blake2b-128"
WSUM64 = "wsum64"
WSUM64_PERIOD = 65521  # the largest prime below 2^16: weights stay < 2^16, byte * weight < 2^24
_MODULUS = WSUM64_PERIOD
CHUNK_BYTES = 1 << 30  # rows per column sum: column sums < 2^14 * 255, weighted sums far below 2^63


def _blake2b(buf: Tensor) -> str:
    return hashlib.blake2b(buf.detach().cpu().numpy().data, digest_size=16).hexdigest()


_WEIGHTS: dict[torch.device, Tensor] = {}
"""Per device, the [2, 65521] int64 rows (1, ..., 1) and (1, ..., 65521): built once, not per bucket."""


def _weights(device: torch.device) -> Tensor:
    if device not in _WEIGHTS:
        w = torch.arange(1, _MODULUS + 1, dtype=torch.int64, device=device)
        _WEIGHTS[device] = torch.stack([torch.ones_like(w), w])
    return _WEIGHTS[device]


def _wsum64_sums(buf: Tensor, chunk_bytes: int) -> Tensor:
    """(sum b_i, sum b_i * w_i) of a flat uint8 buffer as one int64 [2] tensor on its device.

    The weights repeat every 65521 bytes, so the buffer is read as rows of 65521 bytes: one column
    sum over the rows (exact in int64; `chunk_bytes` bounds the rows per sum), the short tail row
    added to the first columns, then one product with the rows (1, ...) and (1, ..., 65521) and one
    sum: a handful of kernels per bucket whatever its size. Sums wrap modulo 2^64 like the digest."""
    n = buf.numel()
    rows, tail = divmod(n, _MODULUS)
    rows_per_chunk = max(1, chunk_bytes // _MODULUS)
    cols: Tensor | None = None
    for first in range(0, rows, rows_per_chunk):
        last = min(rows, first + rows_per_chunk)
        part = _column_sums(buf[first * _MODULUS : last * _MODULUS].view(last - first, _MODULUS))
        cols = part if cols is None else cols.add_(part)
    if cols is None:
        cols = torch.zeros(_MODULUS, dtype=torch.int64, device=buf.device)
    if tail:
        cols[:tail] += buf[rows * _MODULUS :]
    return (cols * _weights(buf.device)).sum(dim=1)


_GROUP_ROWS = 128
"""Rows summed in int16: 128 * 255 = 32640 < 2^15, so a group's column sums are exact."""


def _column_sums(rows: Tensor) -> Tensor:
    """Exact int64 column sums of a [r, 65521] uint8 tensor. An integer sum into a wider dtype
    first converts its whole input (`sum(dtype=int64)` of bytes writes and reads 8 bytes per byte),
    so the bytes are widened to int16 only (2 bytes per byte), summed in groups of `_GROUP_ROWS`
    rows without changing dtype, and only the r / 128 group sums are widened to int64."""
    r = rows.shape[0]
    full = r // _GROUP_ROWS * _GROUP_ROWS
    parts: list[Tensor] = []
    if full:
        groups = rows[:full].view(full // _GROUP_ROWS, _GROUP_ROWS, _MODULUS).to(torch.int16)
        parts.append(groups.sum(dim=1, dtype=torch.int16).sum(dim=0, dtype=torch.int64))
    if r > full:
        parts.append(rows[full:].to(torch.int16).sum(dim=0, dtype=torch.int16).to(torch.int64))
    return parts[0] if len(parts) == 1 else parts[0].add_(parts[1])


def wsum64_digest(n: int, plain: int, weighted: int) -> str:
    """The wsum64 digest string of `n` bytes with these byte and weighted sums (taken modulo 2^64)."""
    mask = (1 << 64) - 1
    return f"{n:x}-{plain & mask:016x}{weighted & mask:016x}"


def wsum64(buf: Tensor, chunk_bytes: int = CHUNK_BYTES) -> str:
    """The wsum64 digest of a flat uint8 buffer (independent of `chunk_bytes` and device): a few
    kernels and one host read."""
    plain, weighted = _wsum64_sums(buf, chunk_bytes).tolist()
    return wsum64_digest(buf.numel(), plain, weighted)


def bucket_checksum(buf: Tensor, algorithm: str | None = None) -> str:
    """`<algorithm>:<digest>` of a flat uint8 buffer; by default blake2b on CPU, wsum64 elsewhere."""
    if algorithm is None:
        algorithm = BLAKE2B if buf.device.type == "cpu" else WSUM64
    if algorithm == BLAKE2B:
        return f"{BLAKE2B}:{_blake2b(buf)}"
    if algorithm == WSUM64:
        return f"{WSUM64}:{wsum64(buf)}"
    raise SyncRefused(f"unknown bucket checksum algorithm {algorithm!r} (known: {BLAKE2B}, {WSUM64})")


def checksum_algorithm(checksum: str) -> str:
    """The algorithm a checksum string names."""
    algorithm, sep, _ = checksum.partition(":")
    if not sep or algorithm not in (BLAKE2B, WSUM64):
        raise SyncRefused(f"bucket checksum {checksum[:40]!r} names no known algorithm ({BLAKE2B}, {WSUM64})")
    return algorithm


class PendingChecksums:
    """Bucket checksums with the device-side wsum64 sums launched but not read yet, so a caller can
    queue more device work (or read other device values with them, `read(extra=...)`) before the
    one host read per device that waits for it. blake2b (host memory) is computed at once."""

    def __init__(self, bufs: Sequence[Tensor], algorithms: Sequence[str | None] | None = None) -> None:
        algos = [None] * len(bufs) if algorithms is None else list(algorithms)
        if len(algos) != len(bufs):
            raise SyncRefused(f"{len(algos)} checksum algorithms for {len(bufs)} buckets")
        self._sizes = [buf.numel() for buf in bufs]
        self._out: list[str | None] = [None] * len(bufs)
        self._pending: dict[torch.device, list[tuple[int, Tensor]]] = {}
        for i, (buf, algorithm) in enumerate(zip(bufs, algos)):
            if (algorithm or (BLAKE2B if buf.device.type == "cpu" else WSUM64)) == WSUM64:
                self._pending.setdefault(buf.device, []).append((i, _wsum64_sums(buf, CHUNK_BYTES)))
            else:
                self._out[i] = bucket_checksum(buf, algorithm)

    def read(self, extra: Tensor | None = None) -> tuple[list[str], list[int]]:
        """(the checksums in bucket order, the values of `extra`: a 1-D integer or bool tensor read in
        the same host transfer as the sums on its device, or on its own if it has none)."""
        extra_values: list[int] = []
        if extra is not None and extra.device not in self._pending:
            extra_values = extra.to(torch.int64).tolist()
        for device, sums in self._pending.items():
            values = torch.stack([s for _, s in sums]).reshape(-1)
            tail = 0
            if extra is not None and extra.device == device:
                values = torch.cat([values, extra.to(torch.int64)])
                tail = extra.numel()
            flat = values.tolist()
            if tail:
                flat, extra_values = flat[:-tail], flat[-tail:]
            for k, (i, _) in enumerate(sums):
                self._out[i] = f"{WSUM64}:{wsum64_digest(self._sizes[i], flat[2 * k], flat[2 * k + 1])}"
        self._pending = {}
        return [c for c in self._out if c is not None], extra_values


def bucket_checksums(bufs: Sequence[Tensor], algorithms: Sequence[str | None] | None = None) -> list[str]:
    """`bucket_checksum` of every buffer, with the device-side sums of all wsum64 buffers read back
    in one host transfer per device (not one per bucket: each read waits for the device)."""
    return PendingChecksums(bufs, algorithms).read()[0]
