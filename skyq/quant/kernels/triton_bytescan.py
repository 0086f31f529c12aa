"""Triton kernel for `skyq.sync.scan`: the wsum64 sums and value flags of a weight-sync bucket in
one pass over its bytes.

A bucket is described by a table of chunks (`start, end, word - 1, mask` per row, int64; at most
`CHUNK_BYTES` each, starts 16-byte aligned). One program reads one chunk once and writes one row of
int64 partials: the byte sum, the weighted byte sum (weights `i mod 65521 + 1`, `i` the byte's index
in the bucket) and a flag. The flag is set when the most significant byte of a word of the chunk's
dtype (`word` bytes, little-endian) has all the bits of `mask` set: 0x7F on an e4m3 byte is a NaN
code, on a bf16 / fp32 / fp64 high byte an exponent of at least all-ones-but-one (non-finite, or a
finite value above 2^127 that the exact check then clears); 0x7C on an fp16 high byte is exactly
an all-ones exponent. `mask` 0 checks nothing (integer tensors, the gaps between spans).

Per lane, byte sums and weighted sums stay in int32: at most `MAX_ITERS` blocks of one byte
(<= 255) times one weight (<= 65521) per lane, below 2^31. The partials of a bucket are summed in
int64 by the caller; the torch reference of the same sums is `skyq.sync.checksums`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

_MODULUS = tl.constexpr(65521)
BLOCK = 4096
"""Bytes per step of a program: 16 per thread at 8 warps, one 16-byte load each."""
MAX_ITERS = 16
CHUNK_BYTES = BLOCK * MAX_ITERS
"""Bytes per program at most (64 KiB)."""
NUM_WARPS = 8


@triton.jit(do_not_specialize=["first"])
def _scan_kernel(frame_ptr, desc_ptr, part_ptr, first, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    c = first + tl.program_id(0).to(tl.int64)
    d = desc_ptr + c * 4
    start = tl.multiple_of(tl.load(d), 16)
    end = tl.load(d + 1)
    wmask = tl.load(d + 2).to(tl.int32)
    vmask = tl.load(d + 3).to(tl.int32)
    vmask = tl.where(vmask == 0, 0x100, vmask)  # no byte has bit 8: nothing is flagged
    offs = tl.arange(0, BLOCK)
    msb = (offs & wmask) == wmask  # chunk starts are 16-aligned, so word boundaries follow offs
    s1 = tl.zeros([BLOCK], dtype=tl.int32)
    s2 = tl.zeros([BLOCK], dtype=tl.int32)
    bad = tl.zeros([BLOCK], dtype=tl.int32)
    for it in range(0, ITERS):  # a constant trip count; steps past `end` load nothing
        pos = start + it * BLOCK
        ptrs = frame_ptr + pos + offs
        if end - pos >= BLOCK:
            b = tl.load(ptrs).to(tl.int32)
        else:
            b = tl.load(ptrs, mask=offs < end - pos, other=0).to(tl.int32)
        w = (pos % _MODULUS).to(tl.int32) + offs
        w = tl.where(w >= _MODULUS, w - _MODULUS, w) + 1
        s1 += b
        s2 += b * w
        bad = tl.maximum(bad, tl.where(msb & ((b & vmask) == vmask), 1, 0))
    out = part_ptr + c * 3
    tl.store(out, tl.sum(s1.to(tl.int64), axis=0))
    tl.store(out + 1, tl.sum(s2.to(tl.int64), axis=0))
    tl.store(out + 2, tl.max(bad, axis=0).to(tl.int64))


def launch(frames: list[Tensor], desc: Tensor, first: list[int], counts: list[int]) -> Tensor:
    """Partials [chunks, 3] int64 (byte sum, weighted sum, flag) of every chunk of every frame:
    frame `f` owns rows `first[f] : first[f] + counts[f]` of `desc` [chunks, 4] int64 (on the
    frames' device). One launch per non-empty frame, no host sync."""
    part = torch.empty((desc.shape[0], 3), dtype=torch.int64, device=desc.device)
    for frame, row, n in zip(frames, first, counts):
        if n:
            _scan_kernel[(n,)](frame, desc, part, row, BLOCK=BLOCK, ITERS=MAX_ITERS, num_warps=NUM_WARPS)
    return part
