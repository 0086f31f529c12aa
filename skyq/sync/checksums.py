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

import torch
from torch import Tensor

from skyq.sync.errors import SyncRefused

BLAKE2B = "blake2b-128"
WSUM64 = "wsum64"
_MODULUS = 65521  # the largest prime below 2^16: weights stay < 2^16, byte * weight < 2^24
CHUNK_BYTES = 1 << 30  # rows per column sum: column sums < 2^14 * 255, weighted sums far below 2^63


def _blake2b(buf: Tensor) -> str:
    return hashlib.blake2b(buf.detach().cpu().numpy().data, digest_size=16).hexdigest()


def wsum64(buf: Tensor, chunk_bytes: int = CHUNK_BYTES) -> str:
    """The wsum64 digest of a flat uint8 buffer (independent of `chunk_bytes` and device).

    The weights repeat every 65521 bytes, so the buffer is read as rows of 65521 bytes: one column
    sum over the rows (exact in int64), then a dot with the weights 1..65521, plus the short tail
    row. A few kernels and one host read per bucket; `chunk_bytes` bounds the rows per column sum."""
    n = buf.numel()
    rows, tail = divmod(n, _MODULUS)
    weights = torch.arange(1, _MODULUS + 1, dtype=torch.int64, device=buf.device)
    rows_per_chunk = max(1, chunk_bytes // _MODULUS)
    plain = torch.zeros((), dtype=torch.int64, device=buf.device)
    weighted = torch.zeros((), dtype=torch.int64, device=buf.device)
    for first in range(0, rows, rows_per_chunk):
        last = min(rows, first + rows_per_chunk)
        cols = (
            buf[first * _MODULUS : last * _MODULUS].view(last - first, _MODULUS).sum(dim=0, dtype=torch.int64)
        )
        plain += cols.sum()
        weighted += (cols * weights).sum()
    if tail:
        rest = buf[rows * _MODULUS :].to(torch.int64)
        plain += rest.sum()
        weighted += (rest * weights[:tail]).sum()
    plain_v, weighted_v = torch.stack([plain, weighted]).tolist()
    mask = (1 << 64) - 1
    return f"{n:x}-{plain_v & mask:016x}{weighted_v & mask:016x}"


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
