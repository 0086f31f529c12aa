"""One pass over a sync's buckets: their wsum64 checksums and their value flags together.

Both ends of a sync read every bucket twice over otherwise: once for the checksum (`checksums`),
once for the value check of its float and e4m3 spans (`values`), a handful of kernels per bucket
and per span. On CUDA with Triton, `PendingScan` reads each bucket once with one kernel launch
(`skyq.quant.kernels.triton_bytescan`), driven by a chunk table (`ScanPlan`) derived from the
layout once and kept with it; the sums of all buckets and every flag come back in one host read.
Elsewhere (CPU buckets, blake2b checksums, no Triton) it runs the torch paths of `checksums` and
`values`, with the same checksums and the same meaning of a flag: a flag can be a false alarm (a
finite value above 2^127 in a bf16 / fp32 span, a float sum that overflowed), which the exact
per-tensor check then clears; a non-finite value or an e4m3 NaN code always sets one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from skyq.quant.kernels.dispatch import uses_kernel
from skyq.sync.byte_runs import ALIGN_BYTES, aligned
from skyq.sync.checksums import WSUM64, WSUM64_PERIOD, PendingChecksums, wsum64_digest
from skyq.sync.errors import SyncError
from skyq.sync.values import Span, span_flags

CHUNK_BYTES = 32 * 1024
"""Bytes per kernel program at most (`triton_bytescan.CHUNK_BYTES`)."""
_MODULUS = WSUM64_PERIOD  # where the wsum64 weights start over

WORD_MASKS: dict[torch.dtype, tuple[int, int]] = {
    torch.float8_e4m3fn: (1, 0x7F),
    torch.bfloat16: (2, 0x7F),
    torch.float16: (2, 0x7C),
    torch.float32: (4, 0x7F),
    torch.float64: (8, 0x7F),
}
"""Per checked dtype, (bytes per word, the bits of its most significant byte that a non-finite
value or NaN code has all set; see `triton_bytescan`)."""


@dataclass(frozen=True, slots=True)
class ScanPlan:
    """The chunk table of a layout's buckets: rows (start, end, word - 1, mask, bucket) in bucket
    order; bucket `b` owns rows `first[b] : first[b] + counts[b]`."""

    nbytes: tuple[int, ...]
    rows: tuple[tuple[int, int, int, int, int], ...]
    first: tuple[int, ...]
    counts: tuple[int, ...]
    _tables: dict[torch.device, tuple[Tensor, Tensor]] = field(
        default_factory=dict, compare=False, repr=False
    )

    @classmethod
    def of(cls, bucket_nbytes: Sequence[int], spans: Sequence[Sequence[Span]]) -> ScanPlan:
        """Split each bucket into segments (a span of one checked dtype, zero padding to the next
        16-byte boundary included, or the unchecked bytes between spans) and the segments into
        chunks of at most `CHUNK_BYTES`. Every chunk starts 16-byte aligned (tensor offsets in a
        bucket are), so a word's most significant byte is found from its offset alone; a chunk is
        also cut 16-aligned just before each multiple of 65521, so the wsum64 weights start over,
        if at all, within a chunk's first 16 bytes (what the kernel corrects for)."""
        if len(spans) != len(bucket_nbytes):
            raise SyncError(f"{len(spans)} span lists for {len(bucket_nbytes)} buckets")
        rows: list[tuple[int, int, int, int, int]] = []
        first, counts = [], []
        for b, (nbytes, bucket_spans) in enumerate(zip(bucket_nbytes, spans)):
            first.append(len(rows))
            for start, end, word, mask in _segments(nbytes, bucket_spans):
                lo = start
                while lo < end:
                    hi = min(end, lo + CHUNK_BYTES)
                    restart = (lo // _MODULUS + 1) * _MODULUS  # the next multiple after lo
                    cut = restart // ALIGN_BYTES * ALIGN_BYTES
                    if lo < cut < hi:
                        hi = cut
                    rows.append((lo, hi, word - 1, mask, b))
                    lo = hi
            counts.append(len(rows) - first[-1])
        return cls(nbytes=tuple(bucket_nbytes), rows=tuple(rows), first=tuple(first), counts=tuple(counts))

    def tables(self, device: torch.device) -> tuple[Tensor, Tensor]:
        """(the rows as int64 [chunks, 5], each row's bucket as int64 [chunks]) on `device`, made
        once per device."""
        if device not in self._tables:
            rows = torch.tensor(self.rows, dtype=torch.int64).reshape(-1, 5).to(device)
            self._tables[device] = (rows, rows[:, 4].contiguous())
        return self._tables[device]


def _segments(nbytes: int, spans: Sequence[Span]) -> list[tuple[int, int, int, int]]:
    """(start, end, word, mask) covering [0, nbytes) in order; mask 0 for unchecked bytes."""
    out: list[tuple[int, int, int, int]] = []
    pos = 0
    for start, end, dtype in sorted(spans):
        if start % ALIGN_BYTES or start < pos:
            raise SyncError(f"value span [{start}, {end}) is not {ALIGN_BYTES}-byte aligned after byte {pos}")
        if start > pos:
            out.append((pos, start, 1, 0))
        word, mask = WORD_MASKS[dtype]
        pos = min(aligned(end), nbytes)
        out.append((start, pos, word, mask))
    if pos < nbytes:
        out.append((pos, nbytes, 1, 0))
    return out


def scan_kernel_applies(frames: Sequence[Tensor], algorithms: Sequence[str | None] | None) -> bool:
    """Whether `PendingScan` runs the Triton kernel: every frame a 16-byte aligned CUDA tensor
    (Triton importable) on one device and every checksum wsum64 (the default for device buffers)."""
    return (
        bool(frames)
        and all(uses_kernel(f) and f.device == frames[0].device and f.data_ptr() % 16 == 0 for f in frames)
        and (algorithms is None or all(a in (None, WSUM64) for a in algorithms))
    )


class PendingScan:
    """The checksums and value flags of a sync's buckets, launched at construction and read once.

    `spans[b]` are bucket `b`'s value spans (`values.find_spans`), `plan` their `ScanPlan` (kept
    with the layout). `algorithms` names each bucket's checksum (None: blake2b for host memory,
    wsum64 for device memory)."""

    def __init__(
        self,
        frames: Sequence[Tensor],
        spans: Sequence[Sequence[Span]],
        plan: ScanPlan,
        algorithms: Sequence[str | None] | None = None,
        *,
        checksums: bool = True,
    ) -> None:
        self._sizes = [f.numel() for f in frames]
        self._checksums = checksums
        self._sums: Tensor | None = None
        self._pending: PendingChecksums | None = None
        self._flags: Tensor | None = None
        if scan_kernel_applies(frames, algorithms):
            from skyq.quant.kernels import triton_bytescan

            if len(plan.counts) != len(frames) or any(
                f.numel() != plan_bytes for f, plan_bytes in zip(frames, plan.nbytes)
            ):
                raise SyncError(
                    f"scan plan for buckets of {list(plan.nbytes)} bytes given frames of {self._sizes}"
                )
            # The kernel reads at most its chunk size per program: the plan must not cut larger.
            assert triton_bytescan.CHUNK_BYTES == CHUNK_BYTES, (triton_bytescan.CHUNK_BYTES, CHUNK_BYTES)
            rows, bucket = plan.tables(frames[0].device)
            part = triton_bytescan.launch(list(frames), rows)  # every bucket, one launch
            # Per bucket: the int64 sums of its rows (exact; flags counted), one kernel.
            self._sums = part.new_zeros((len(frames), 3)).index_add_(0, bucket, part)
            return
        if checksums:
            self._pending = PendingChecksums(frames, algorithms)
        self._flags = span_flags(frames, spans)

    def read(self) -> tuple[list[str], bool]:
        """(the checksums in bucket order, or [] when not asked for; whether any value flag is set).
        One host read per device."""
        if self._sums is not None:
            return self._read_kernel(self._sums)
        if self._pending is not None:
            checksums, flags = self._pending.read(extra=self._flags)
            return checksums, any(flags)
        return [], self._flags is not None and bool(self._flags.any())

    def _read_kernel(self, sums: Tensor) -> tuple[list[str], bool]:
        values = sums.tolist()
        bad = any(v[2] for v in values)
        if not self._checksums:
            return [], bad
        return [f"{WSUM64}:{wsum64_digest(n, v[0], v[1])}" for n, v in zip(self._sizes, values)], bad
