"""Few large byte ranges instead of one per tensor: packing and unpacking a bucket in bulk.

A bucket holds hundreds of small wire tensors (one projection's experts, each with its scales). Per
tensor Python and one kernel per tensor would make a sync cost per tensor, not per byte, so:
the sender copies the members of one batched quantizer output (a stack's whole tensor) that lie at
the alignment pitch in a bucket as ONE strided byte range (a `Copy`), and the receiver views each
run of equal entries at that pitch as one stacked tensor split with `unbind` (a `Run`). Neither
changes a byte or what the manifest says. Copies and runs are computed once per layout and reused
while it holds.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from skyq.sync.manifest import TensorEntry
from skyq.sync.wire_dtypes import dtype_from_name, view_bytes


def interleave(tensor_lists: Sequence[Sequence[object]]) -> list[tuple[int, int]]:
    """(unit, position) pairs in the order the bucket lays them: every unit's first tensor, then
    every unit's second, ... so the codes of stacked experts lie back to back, then their scales."""
    longest = max((len(ts) for ts in tensor_lists), default=0)
    return [(u, k) for k in range(longest) for u, ts in enumerate(tensor_lists) if k < len(ts)]


ALIGN_BYTES = 16
"""Tensor offsets inside a bucket are multiples of this, so every dtype can be viewed in place."""


def aligned(n: int) -> int:
    """`n` rounded up to `ALIGN_BYTES`: the pitch of a tensor of `n` bytes in a bucket."""
    return (n + ALIGN_BYTES - 1) // ALIGN_BYTES * ALIGN_BYTES


class Copy(NamedTuple):
    """One byte range to copy into a bucket: members [first, first + count) of wire position
    `position` of sender item `item` (a stack's whole tensor, or one tensor of a unit, first 0),
    laid from `offset` every `stride` bytes, `nbytes` each (zero padding in between)."""

    item: int
    position: int
    first: int
    count: int
    offset: int
    nbytes: int
    stride: int

    @property
    def end(self) -> int:
        return self.offset + (self.count - 1) * self.stride + self.nbytes


def plan_copies(
    offsets: Sequence[int],
    nbytes: Sequence[int],
    members: Sequence[tuple[int, int, int]],
    stacked: Sequence[bool],
) -> tuple[Copy, ...]:
    """The copies that lay a bucket: its tensors (in byte order, at `offsets`, `nbytes` each) are
    members `(item, position, index)`; consecutive members of one stacked item's wire position at
    the alignment pitch are one copy. Derived from the layout alone, so a cached plan holds for any
    later sync of the same items."""
    copies: list[Copy] = []
    for offset, size, (item, position, index) in zip(offsets, nbytes, members):
        last = copies[-1] if copies else None
        if (
            last is not None
            and stacked[item]
            and (last.item, last.position, last.first + last.count) == (item, position, index)
            and size == last.nbytes
            and offset == last.offset + last.count * last.stride
        ):
            copies[-1] = last._replace(count=last.count + 1)
        else:
            copies.append(Copy(item, position, index, 1, offset, size, aligned(size)))
    return tuple(copies)


def gather(sources: Sequence[Tensor], copies: Sequence[Copy], nbytes: int, device: torch.device) -> Tensor:
    """The bucket: each copy's source bytes (`count * nbytes` of them, flat uint8) laid out as the
    copy says, zero padding between, as one `torch.cat`."""
    parts: list[Tensor] = []
    zeros: Tensor | None = None
    written = 0
    for src, copy in zip(sources, copies, strict=True):
        if copy.offset > written:  # padding: less than the alignment
            if zeros is None or zeros.numel() < copy.offset - written:
                zeros = torch.zeros(max(16, copy.offset - written), dtype=torch.uint8, device=device)
            parts.append(zeros[: copy.offset - written])
        src = src.to(device)
        if copy.count > 1 and copy.stride != copy.nbytes:  # members that padding separates
            padded = torch.zeros(copy.count, copy.stride, dtype=torch.uint8, device=device)
            padded[:, : copy.nbytes] = src.view(copy.count, copy.nbytes)
            src = padded.view(-1)[: copy.end - copy.offset]
        parts.append(src)
        written = copy.end
    if written != nbytes:
        raise AssertionError(f"bucket packed to {written} bytes, its layout says {nbytes}")
    if not parts:
        return torch.zeros(0, dtype=torch.uint8, device=device)
    return torch.cat(parts) if len(parts) > 1 else parts[0].clone()


class Run(NamedTuple):
    """`count` bucket entries of one dtype and shape, one every `stride` bytes (`nbytes` each,
    padding between), viewed once and unbound."""

    offset: int
    count: int
    nbytes: int
    """Bytes of one member."""
    stride: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    names: tuple[str, ...]

    @property
    def end(self) -> int:
        return self.offset + (self.count - 1) * self.stride + self.nbytes


def find_runs(entries: Sequence[TensorEntry]) -> tuple[Run, ...]:
    """The entries (any order) as runs, in byte order."""
    ordered = sorted(entries, key=lambda e: e.offset)
    runs: list[Run] = []
    i = 0
    while i < len(ordered):
        first = ordered[i]
        stride = aligned(first.nbytes)
        j = i + 1
        while (
            j < len(ordered)
            and ordered[j].dtype == first.dtype
            and ordered[j].shape == first.shape
            and ordered[j].offset == ordered[j - 1].offset + stride
        ):
            j += 1
        names = tuple(e.name for e in ordered[i:j])
        dtype = dtype_from_name(first.dtype)
        runs.append(Run(first.offset, j - i, first.nbytes, stride, dtype, first.shape, names))
        i = j
    return tuple(runs)


def view_runs(buf: Tensor, runs: Sequence[Run], out: dict[str, Tensor]) -> None:
    """Put every run member's tensor into `out`: views into `buf` (a copy only where a view
    cannot be taken: bool, misaligned bytes)."""
    for run in runs:
        out.update(zip(run.names, run_views(buf, run)))


def run_views(buf: Tensor, run: Run) -> Sequence[Tensor]:
    """The run's members, in order: views into `buf` (one `unbind` of the whole run where the bytes
    are aligned for the dtype), a copy only where a view cannot be taken (bool, misaligned bytes)."""
    offset, count, nbytes, stride, dtype, shape, _ = run
    whole = _run_view(buf, run) if count > 1 and nbytes > 0 and dtype != torch.bool else None
    if whole is not None:
        return whole.unbind(0)
    return [
        view_bytes(buf[offset + k * stride : offset + k * stride + nbytes], dtype, shape)
        for k in range(count)
    ]


def _run_view(buf: Tensor, run: Run) -> Tensor | None:
    """The run's members as one [count, *shape] view into `buf` (strided over the padding when
    there is any), or None when the bytes are not aligned for the dtype."""
    return member_view(buf, run.offset, run.count, run.nbytes, run.stride, run.dtype, run.shape)


def member_view(
    buf: Tensor, offset: int, count: int, nbytes: int, stride: int, dtype: torch.dtype, shape: Sequence[int]
) -> Tensor | None:
    """`count` tensors of `dtype` and `shape` (`nbytes` each) at `offset` of the uint8 `buf`, one
    every `stride` bytes, as one [count, *shape] view (strided over any padding); None when the
    bytes are not aligned for the dtype."""
    raw = buf[offset : offset + (count - 1) * stride + nbytes]
    size = dtype.itemsize
    if raw.data_ptr() % size or nbytes % size or stride % size:
        return None
    if stride != nbytes:
        raw = raw.as_strided((count, nbytes), (stride, 1))
    return raw.view(dtype).view(count, *shape)


def unpack_views(buf: Tensor, entries: Sequence[TensorEntry]) -> dict[str, Tensor]:
    """Every entry's tensor as a view into `buf` (see `view_runs`), in byte order."""
    out: dict[str, Tensor] = {}
    view_runs(buf, find_runs(entries), out)
    return out


WORDS = (torch.int32, torch.int16, torch.uint8)
"""Integer words a tensor's bytes are copied as, widest first (`word_dtype`). Not int64: torch's
multi-tensor copy moves 16-byte vectors only where every tensor is aligned to four of its elements,
and tensors in a bucket are 16-byte aligned, i.e. often not 32 (int64 words took the scalar path)."""


def word_dtype(*numbers: int) -> torch.dtype:
    """The widest word in `WORDS` whose size divides every number (byte sizes, offsets, addresses)."""
    for word in WORDS:
        if all(n % word.itemsize == 0 for n in numbers):
            return word
    return torch.uint8


class WordRun(NamedTuple):
    """A run's members as the rows of one [count, words] view of their bytes in one integer word
    (`WORDS`): what a commit copies, so a 1-byte dtype costs as few elements as an 8-byte one."""

    word: torch.dtype
    names: tuple[str, ...]
    whole: Tensor
    """[count, member bytes / word size], row i the member `names[i]` (rows `stride` bytes apart)."""

    @property
    def views(self) -> Sequence[Tensor]:
        """Each member's flat word view (one `unbind`; a copy into one stacked destination needs none)."""
        return self.whole.unbind(0)


def word_runs(buf: Tensor, runs: Sequence[Run]) -> list[WordRun]:
    """Every run of `buf` with members (of more than 0 bytes, not bool) as `WordRun`s: the widest word
    that divides the member size, the pitch and the address; no per-member view."""
    out: list[WordRun] = []
    for run in runs:
        if run.nbytes == 0 or run.dtype == torch.bool:
            continue
        raw = buf[run.offset : run.end]
        word = word_dtype(run.nbytes, run.stride, raw.data_ptr(), raw.storage_offset())
        if run.count > 1 and run.stride != run.nbytes:
            raw = raw.as_strided((run.count, run.nbytes), (run.stride, 1))
        else:
            raw = raw.view(run.count, run.nbytes)
        out.append(WordRun(word, run.names, raw.view(word)))
    return out
