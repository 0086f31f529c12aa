"""Few large byte ranges instead of one per tensor: packing and unpacking a bucket in bulk.

A bucket holds hundreds of small wire tensors (one projection's experts, each with its scales). Per
tensor Python and one kernel per tensor would make a sync cost per tensor, not per byte, so:
the sender copies tensors that lie back to back in one storage (views of one batched quantizer
output) as ONE byte range (a `Piece`), and the receiver views each run of equal, back-to-back
entries as one stacked tensor split with `unbind` (a `Run`). Neither changes a byte or what the
manifest says. Pieces and runs are computed once per layout and reused while it holds.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from skyq.sync.manifest import TensorEntry
from skyq.sync.wire_dtypes import as_bytes, dtype_from_name, view_bytes


def interleave(tensor_lists: Sequence[Sequence[object]]) -> list[tuple[int, int]]:
    """(unit, position) pairs in the order the bucket lays them: every unit's first tensor, then
    every unit's second, ... so the codes of stacked experts lie back to back, then their scales."""
    longest = max((len(ts) for ts in tensor_lists), default=0)
    return [(u, k) for k in range(longest) for u, ts in enumerate(tensor_lists) if k < len(ts)]


class Piece(NamedTuple):
    """Bucket members [first, first + count) (in byte order), back to back in the bucket: one
    byte range to copy when they are also back to back in one storage on the sender."""

    first: int
    count: int
    offset: int
    """Bucket offset of the first member."""
    nbytes: int
    """Bytes of all members."""


def _one_range(run: Sequence[Tensor], device: torch.device) -> Tensor | None:
    """`run`'s bytes as one uint8 view when its tensors are contiguous and back to back in one
    storage on `device`, else None."""
    first = run[0]
    if first.device != device:
        return None
    storage = first.untyped_storage()
    base = storage.data_ptr()
    addr = first.data_ptr()
    for t in run:
        if t.data_ptr() != addr or not t.is_contiguous() or t.untyped_storage().data_ptr() != base:
            return None
        addr += t.nbytes
    start = first.data_ptr() - base
    view = torch.empty(0, dtype=torch.uint8, device=device)
    return view.set_(storage, start, (addr - first.data_ptr(),), (1,))


def _continues(prev: Tensor, t: Tensor, device: torch.device) -> bool:
    """True when `t` starts where `prev` ends, both contiguous in one storage on `device`."""
    return (
        t.nbytes > 0
        and prev.nbytes > 0
        and prev.device == device
        and prev.is_contiguous()
        and t.is_contiguous()
        and t.data_ptr() == prev.data_ptr() + prev.nbytes
        and t.untyped_storage().data_ptr() == prev.untyped_storage().data_ptr()
    )


def find_pieces(tensors: Sequence[Tensor], offsets: Sequence[int], device: torch.device) -> tuple[Piece, ...]:
    """Group the members (in byte order, at `offsets`) into pieces: a member joins the previous
    piece when no padding separates them in the bucket and they continue each other in memory."""
    pieces: list[Piece] = []
    for i, (t, offset) in enumerate(zip(tensors, offsets)):
        last = pieces[-1] if pieces else None
        if last is not None and offset == last.offset + last.nbytes and _continues(tensors[i - 1], t, device):
            pieces[-1] = last._replace(count=last.count + 1, nbytes=last.nbytes + t.nbytes)
        else:
            pieces.append(Piece(i, 1, offset, t.nbytes))
    return tuple(pieces)


def gather(tensors: Sequence[Tensor], pieces: Sequence[Piece], nbytes: int, device: torch.device) -> Tensor:
    """The bucket: `tensors`' bytes laid out as `pieces` say, zero padding between, as one
    `torch.cat`. A piece whose members no longer lie back to back is copied member by member."""
    parts: list[Tensor] = []
    zeros: Tensor | None = None
    written = 0
    for first, count, offset, piece_bytes in pieces:
        if offset > written:  # padding: less than the alignment
            if zeros is None or zeros.numel() < offset - written:
                zeros = torch.zeros(max(16, offset - written), dtype=torch.uint8, device=device)
            parts.append(zeros[: offset - written])
        members = tensors[first : first + count]
        whole = _one_range(members, device) if count > 1 else None
        if whole is not None:
            parts.append(whole)
        else:
            parts.extend(as_bytes(t).to(device) for t in members)
        written = offset + piece_bytes
    if written != nbytes:
        raise AssertionError(f"bucket packed to {written} bytes, its layout says {nbytes}")
    if not parts:
        return torch.zeros(0, dtype=torch.uint8, device=device)
    return torch.cat(parts) if len(parts) > 1 else parts[0].clone()


class Run(NamedTuple):
    """`count` back-to-back bucket entries of one dtype and shape, viewed once and unbound."""

    offset: int
    count: int
    nbytes: int
    """Bytes of one member."""
    dtype: torch.dtype
    shape: tuple[int, ...]
    names: tuple[str, ...]


def find_runs(entries: Sequence[TensorEntry]) -> tuple[Run, ...]:
    """The entries (any order) as runs, in byte order."""
    ordered = sorted(entries, key=lambda e: e.offset)
    runs: list[Run] = []
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
        names = tuple(e.name for e in ordered[i:j])
        runs.append(Run(first.offset, j - i, first.nbytes, dtype_from_name(first.dtype), first.shape, names))
        i = j
    return tuple(runs)


def view_runs(buf: Tensor, runs: Sequence[Run], out: dict[str, Tensor]) -> None:
    """Put every run member's tensor into `out`: views into `buf` (a copy only where a view
    cannot be taken: bool, misaligned bytes)."""
    for offset, count, nbytes, dtype, shape, names in runs:
        if count > 1 and nbytes > 0 and dtype != torch.bool:
            whole = view_bytes(buf[offset : offset + count * nbytes], dtype, (count, *shape))
            out.update(zip(names, whole.unbind(0)))
        else:
            for k, name in enumerate(names):
                start = offset + k * nbytes
                out[name] = view_bytes(buf[start : start + nbytes], dtype, shape)


def unpack_views(buf: Tensor, entries: Sequence[TensorEntry]) -> dict[str, Tensor]:
    """Every entry's tensor as a view into `buf` (see `view_runs`), in byte order."""
    out: dict[str, Tensor] = {}
    view_runs(buf, find_runs(entries), out)
    return out
