"""Few large byte ranges instead of one per tensor: packing and unpacking a bucket in bulk.

A bucket holds hundreds of small wire tensors (one projection's experts, each with its scales). Per
tensor Python and one kernel per tensor would make a sync cost per tensor, not per byte, so:
the sender lays tensors that already sit back to back in memory (views of one batched quantizer
output) as ONE byte range, and the receiver views each run of equal, back-to-back entries as one
stacked tensor split with `unbind`. Neither changes a byte or what the manifest says.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from skyq.sync.manifest import TensorEntry
from skyq.sync.wire_dtypes import as_bytes, dtype_from_name, view_bytes


def interleave(tensor_lists: Sequence[Sequence[object]]) -> list[tuple[int, int]]:
    """(unit, position) pairs in the order the bucket lays them: every unit's first tensor, then
    every unit's second, ... so the codes of stacked experts lie back to back, then their scales."""
    longest = max((len(ts) for ts in tensor_lists), default=0)
    return [(u, k) for k in range(longest) for u, ts in enumerate(tensor_lists) if k < len(ts)]


class BytePieces:
    """Collects byte ranges for one `torch.cat`, merging a tensor into the previous range when it
    continues it in the same storage (no copy, no per-tensor piece)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pieces: list[Tensor] = []
        self.written = 0
        self._run: tuple[Tensor, int, int] | None = None  # (first tensor, storage byte offset, bytes)
        self._run_len = 0

    def pad_to(self, offset: int) -> None:
        if offset > self.written:
            self._flush()
            self.pieces.append(torch.zeros(offset - self.written, dtype=torch.uint8, device=self.device))
            self.written = offset

    def add(self, t: Tensor) -> None:
        nbytes = t.numel() * t.element_size()
        mergeable = t.device == self.device and t.is_contiguous() and nbytes > 0
        start = t.storage_offset() * t.element_size() if mergeable else -1
        run = self._run
        if (
            run is not None
            and mergeable
            and start == run[1] + run[2]
            and t.untyped_storage().data_ptr() == run[0].untyped_storage().data_ptr()
        ):
            self._run = (run[0], run[1], run[2] + nbytes)
            self._run_len += 1
        else:
            self._flush()
            if mergeable:
                self._run, self._run_len = (t, start, nbytes), 1
            else:
                self.pieces.append(as_bytes(t).to(self.device))
        self.written += nbytes

    def _flush(self) -> None:
        if self._run is None:
            return
        first, start, nbytes = self._run
        if self._run_len == 1:
            self.pieces.append(as_bytes(first))
        else:
            view = torch.empty(0, dtype=torch.uint8, device=self.device)
            self.pieces.append(view.set_(first.untyped_storage(), start, (nbytes,), (1,)))
        self._run, self._run_len = None, 0

    def cat(self) -> Tensor:
        self._flush()
        if not self.pieces:
            return torch.zeros(0, dtype=torch.uint8, device=self.device)
        return torch.cat(self.pieces) if len(self.pieces) > 1 else self.pieces[0].clone()


def unpack_views(buf: Tensor, entries: Sequence[TensorEntry]) -> dict[str, Tensor]:
    """Every entry's tensor as a view into `buf` (a copy only where a view cannot be taken); runs
    of back-to-back entries of one dtype and shape are viewed once and split with `unbind`."""
    out: dict[str, Tensor] = {}
    ordered = sorted(entries, key=lambda e: e.offset)
    i = 0
    while i < len(ordered):
        first = ordered[i]
        j = i + 1
        while (
            j < len(ordered)
            and ordered[j].dtype == first.dtype
            and ordered[j].shape == first.shape
            and ordered[j].offset == ordered[j - 1].offset + first.nbytes
        ):
            j += 1
        dtype = dtype_from_name(first.dtype)
        span = buf[first.offset : first.offset + (j - i) * first.nbytes]
        if j - i > 1 and first.nbytes > 0 and dtype != torch.bool:
            whole = view_bytes(span, dtype, (j - i, *first.shape))
            out.update(zip((e.name for e in ordered[i:j]), whole.unbind(0)))
        else:
            for e in ordered[i:j]:
                out[e.name] = view_bytes(buf[e.offset : e.offset + e.nbytes], dtype, e.shape)
        i = j
    return {e.name: out[e.name] for e in entries}
