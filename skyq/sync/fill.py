"""Filling a repeat sync's buckets in place: the quantizers write straight into the bucket bytes.

A sync whose layout the engine already holds (layout.py) knows, before anything is serialized,
where every wire tensor goes. Its buckets are allocated first (one allocation each, the sizes
packing makes, so the caching allocator can hand back the same blocks every sync), and each wire item's
bytes are written where the layout puts them: a format with a grouped quantizer (FP8 blockwise,
MXFP8, INT4) writes its codes and scales there itself, in one launch for the whole sync, and
everything else (unquantized tensors) is copied there (`copy_into`). No packing pass, no
per-bucket concatenation: the bytes are the same as `SenderLayout.pack`
lays them (padding zeroed), so the checksums and the engine's side do not change.

A `FillPlan` is derived from a layout once. Per wire item it lists `Piece`s: a range of members
(one for a unit, a run of experts for a stack) that lies back to back in one bucket for every wire
position, so each position of a piece is ONE contiguous destination view (a stack's members that
padding separates are pieces of one member each).
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from skyq.sync.byte_runs import Copy, member_view, word_dtype
from skyq.sync.errors import SyncError

BIG_COPY_BYTES = 1 << 20
"""Copies of at least this many bytes run one by one (a device memcpy each); smaller ones are
grouped into one multi-tensor copy per word size."""


class Piece(NamedTuple):
    """Members [first, first + count) of a wire item, whose position k lies in bucket
    `places[k][0]` from byte `places[k][1]`, `places[k][2]` bytes per member, back to back."""

    first: int
    count: int
    places: tuple[tuple[int, int, int], ...]


class FillPlan:
    """Where every wire item of a layout goes in its buckets."""

    def __init__(
        self, bucket_nbytes: Sequence[int], copies: Sequence[Sequence[Copy]], num_items: int
    ) -> None:
        self.nbytes = tuple(bucket_nbytes)
        per_item: list[dict[int, list[tuple[int, int, int, int, int, int]]]] = [{} for _ in range(num_items)]
        covered: list[list[tuple[int, int]]] = [[] for _ in self.nbytes]
        for b, bucket_copies in enumerate(copies):
            for c in bucket_copies:
                per_item[c.item].setdefault(c.position, []).append(
                    (c.first, c.count, b, c.offset, c.nbytes, c.stride)
                )
                covered[b].extend(
                    (c.offset + i * c.stride, c.offset + i * c.stride + c.nbytes) for i in range(c.count)
                )
        self.pieces: tuple[tuple[Piece, ...], ...] = tuple(_pieces(i, p) for i, p in enumerate(per_item))
        self.gaps = tuple(_gaps(n, spans) for n, spans in zip(self.nbytes, covered))
        """Per bucket, the byte ranges no member covers: padding, zeroed on allocation."""
        self._gap_index: dict[tuple[torch.device, int], Tensor] = {}

    def allocate(self, device: torch.device) -> list[Tensor]:
        """The buckets, padding zeroed (one `index_fill_` per bucket that has any), the rest
        uninitialized."""
        bufs = [torch.empty(n, dtype=torch.uint8, device=device) for n in self.nbytes]
        for b, gaps in enumerate(self.gaps):
            if gaps:
                index = self._gap_index.get((device, b))
                if index is None:
                    ranges = torch.cat([torch.arange(lo, hi, dtype=torch.int64) for lo, hi in gaps])
                    index = self._gap_index[device, b] = ranges.to(device)
                bufs[b].index_fill_(0, index, 0)
        return bufs

    def destinations(
        self,
        bufs: Sequence[Tensor],
        item: int,
        specs: Sequence[tuple[torch.dtype, tuple[int, ...]]],
        stacked: bool,
    ) -> list[tuple[int, int, tuple[Tensor, ...]]]:
        """Item `item`'s pieces as (first, count, one view per wire position into `bufs`): of the
        member shape with a leading `count` for a stack, of the wire shape for a unit. `specs`:
        (dtype, shape) per position (a stack's whole [E, ...] shape)."""
        out = []
        for piece in self.pieces[item]:
            views = tuple(
                member_view(bufs[b], offset, piece.count, nbytes, nbytes, dtype, shape[1:])
                if stacked
                else member_view(bufs[b], offset, 1, nbytes, nbytes, dtype, shape)[0]
                for (b, offset, nbytes), (dtype, shape) in zip(piece.places, specs)
            )
            out.append((piece.first, piece.count, views))
        return out


def _pieces(item: int, positions: dict[int, list[tuple[int, int, int, int, int, int]]]) -> tuple[Piece, ...]:
    """Cut an item's copies (per position: first, count, bucket, offset, nbytes, stride) into member
    ranges that are one contiguous range at every position."""
    if not positions:
        return ()
    if sorted(positions) != list(range(len(positions))):
        raise SyncError(f"wire item {item}: the layout places positions {sorted(positions)}")
    edges: set[int] = set()
    for copies in positions.values():
        for first, count, _, _, nbytes, stride in copies:
            edges.update((first, first + count))
            if stride != nbytes:  # padding between members: each its own piece
                edges.update(range(first, first + count))
    cuts = sorted(edges)
    index = {k: sorted(copies) for k, copies in positions.items()}
    pieces = []
    for a, b in zip(cuts, cuts[1:]):
        places = []
        for k in range(len(positions)):
            copies = index[k]
            j = bisect_right([c[0] for c in copies], a) - 1
            if j < 0 or not copies[j][0] <= a < b <= copies[j][0] + copies[j][1]:
                raise SyncError(
                    f"wire item {item}: members {a}..{b - 1} of position {k} are not in one range"
                )
            first, _, bucket, offset, nbytes, stride = copies[j]
            places.append((bucket, offset + (a - first) * stride, nbytes))
        pieces.append(Piece(a, b - a, tuple(places)))
    return tuple(pieces)


def _gaps(nbytes: int, covered: list[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    gaps: list[tuple[int, int]] = []
    pos = 0
    for a, b in sorted(covered):
        if a > pos:
            gaps.append((pos, a))
        pos = max(pos, b)
    if pos < nbytes:
        gaps.append((pos, nbytes))
    return tuple(gaps)


def copy_into(pairs: Sequence[tuple[Tensor, Tensor]]) -> None:
    """`dst.copy_(src)` for every (dst, src) of the same dtype and shape, dst contiguous: as integer
    words, large ones one by one, the rest in one multi-tensor copy per word size."""
    groups: dict[torch.dtype, tuple[list[Tensor], list[Tensor]]] = {}
    with torch.no_grad():
        for dst, src in pairs:
            if dst.shape != src.shape or dst.dtype != src.dtype:
                raise SyncError(
                    f"a wire tensor of {src.dtype}{list(src.shape)} for a place of {dst.dtype}{list(dst.shape)}"
                )
            d = dst.reshape(-1).view(torch.uint8) if dst.dtype != torch.bool else None
            s = src.detach().contiguous().reshape(-1)
            if d is None or s.device != d.device:
                dst.copy_(src)
                continue
            s = s.view(torch.uint8)
            if d.numel() >= BIG_COPY_BYTES:
                d.copy_(s)
                continue
            word = word_dtype(d.numel(), d.data_ptr(), s.data_ptr())
            ds, ss = groups.setdefault(word, ([], []))
            ds.append(d.view(word))
            ss.append(s.view(word))
        for ds, ss in groups.values():
            torch._foreach_copy_(ds, ss)
