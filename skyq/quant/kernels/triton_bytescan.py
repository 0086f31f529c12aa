"""Triton kernel for `skyq.sync.scan`: the wsum64 sums and value flags of a weight-sync bucket in
one pass over its bytes.

A sync's buckets are described by one table of chunks (`start, end, word - 1, mask, bucket` per row,
int64; at most
`CHUNK_BYTES` each, starts 16-byte aligned, and a multiple of 65521 (where the wsum64 weights start
over) never more than 15 bytes after a chunk's start: `scan.ScanPlan` cuts them so). One launch
covers every bucket of a sync (a program finds its bucket's address in a small table: the launch
cost, not the bytes, bounds the scan of a sync of many small buckets). One program reads one chunk
once and writes one row of int64 partials: the byte sum, the weighted byte sum
(weights `i mod 65521 + 1`, `i` the byte's index in the bucket) and a flag.

The bytes are read as 32-bit words, four bytes per lane, with a few integer operations per word
(the count, not the bandwidth, is what bounds such a scan): each lane keeps, in the two 16-bit
halves of two registers, the running sums of its bytes 0 and 2 and of its bytes 1 and 3 (`P`), and
the running sums of those (`Q`). After the loop, `P` gives each byte position's sum and `N * P - Q`
the sum weighted by the step, from which the sum weighted by the byte's offset in the chunk
follows; the modular weights are then one multiply and, for the chunk whose weights start over in
its first 16 bytes, one correction. Halves stay below 2^16: at most `ITERS` bytes of 255 in `P`,
`ITERS * (ITERS + 1) / 2` of them in `Q`. A chunk's last, partial step is read byte by byte.

The flag is set when the most significant byte of a word of the chunk's dtype (`word` bytes,
little-endian) has all the bits of `mask` set, tested on four bytes at once as
`((x & M) + low(M)) & 0x80` per checked byte (no carry crosses a byte): 0x7F on an e4m3 byte is a
NaN code, on a bf16 / fp32 / fp64 high byte an exponent of at least all-ones-but-one (non-finite,
or a finite value above 2^127 that the exact check then clears); 0x7C on an fp16 high byte is
exactly an all-ones exponent. `mask` 0 checks nothing (integer tensors, the gaps between spans).
The torch reference of the sums is `skyq.sync.checksums`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

_MODULUS = tl.constexpr(65521)
WORDS = 1024
"""32-bit words per step of a program: four per thread at 8 warps, one 16-byte load each."""
ITERS = 8
CHUNK_BYTES = 4 * WORDS * ITERS
"""Bytes per program at most (32 KiB, less than 65521: a chunk holds at most one restart of the
weights)."""
NUM_WARPS = 8


@triton.jit
def _scan_kernel(addr_ptr, desc_ptr, part_ptr, WB: tl.constexpr, ITERS: tl.constexpr):
    BLOCK: tl.constexpr = 4 * WB
    c = tl.program_id(0).to(tl.int64)
    d = desc_ptr + c * 5
    start = tl.multiple_of(tl.load(d), 16)
    n = tl.load(d + 1) - start
    wmask = tl.load(d + 2)
    vmask = tl.load(d + 3)
    frame_ptr = tl.load(addr_ptr + tl.load(d + 4)).to(tl.pointer_type(tl.uint8))
    frame_ptr = tl.multiple_of(frame_ptr, 16)  # frames are 16-byte aligned (`scan_kernel_applies`)
    nfull = n // BLOCK
    j = tl.arange(0, WB)

    # Checked bytes of each 32-bit word: every byte (word 1), bytes 1 and 3 (2), byte 3 (4), byte 3
    # of odd words (8: chunk starts are 16-aligned, so word j holds bytes 4j .. 4j + 3).
    pattern = tl.where(wmask == 0, 0x01010101, tl.where(wmask == 1, 0x01000100, 0x01000000))
    lane = tl.where((wmask == 7) & ((j & 1) == 0), 0, pattern + tl.zeros([WB], dtype=tl.int64))
    low = vmask & (0 - vmask)
    m_w = (lane * vmask).to(tl.uint32)
    i_w = (lane * low).to(tl.uint32)
    h_w = (lane * tl.where(vmask == 0, 0, 0x80)).to(tl.uint32)

    # 16-byte aligned (frames are allocations, chunk starts 16-aligned): one 16-byte load per thread.
    words = tl.multiple_of(frame_ptr.to(tl.pointer_type(tl.uint32)) + start // 4, 16)
    pe = tl.zeros([WB], dtype=tl.uint32)
    po = tl.zeros([WB], dtype=tl.uint32)
    qe = tl.zeros([WB], dtype=tl.uint32)
    qo = tl.zeros([WB], dtype=tl.uint32)
    bad = tl.zeros([WB], dtype=tl.uint32)
    for it in range(0, ITERS):
        x = tl.load(words + it * WB + j, mask=it < nfull, other=0)
        pe += x & 0x00FF00FF
        po += (x >> 8) & 0x00FF00FF
        qe += pe
        qo += po
        bad |= ((x & m_w) + i_w) & h_w

    a0 = (pe & 0xFFFF).to(tl.int64)
    a2 = (pe >> 16).to(tl.int64)
    a1 = (po & 0xFFFF).to(tl.int64)
    a3 = (po >> 16).to(tl.int64)
    s = a0 + a1 + a2 + a3
    q = (
        (qe & 0xFFFF).to(tl.int64)
        + (qe >> 16).to(tl.int64)
        + (qo & 0xFFFF).to(tl.int64)
        + (qo >> 16).to(tl.int64)
    )
    by_offset = BLOCK * (ITERS * s - q) + 4 * j.to(tl.int64) * s + a1 + 2 * a2 + 3 * a3
    total = tl.sum(s, axis=0)
    weighted = tl.sum(by_offset, axis=0)  # sum of byte * (its offset in the chunk)
    flag = (tl.max(bad, axis=0) != 0).to(tl.int64)

    rem = n - nfull * BLOCK
    if rem > 0:  # the last, partial step, byte by byte
        offs = tl.arange(0, BLOCK)
        rel = nfull * BLOCK + offs
        b = tl.load(frame_ptr + start + rel, mask=offs < rem, other=0).to(tl.int64)
        total += tl.sum(b, axis=0)
        weighted += tl.sum(b * rel, axis=0)
        msb = (offs & wmask) == wmask
        hit = msb & ((b & vmask) == vmask) & (vmask != 0) & (offs < rem)
        flag = tl.maximum(flag, tl.max(hit.to(tl.int64), axis=0))

    m0 = start % _MODULUS
    weighted += (m0 + 1) * total
    restart = _MODULUS - m0  # offset in the chunk where the weights start over at 1
    if (restart < 16) & (restart < n):
        k = tl.arange(0, 16)
        before = tl.sum(tl.load(frame_ptr + start + k, mask=k < restart, other=0).to(tl.int64), axis=0)
        weighted -= _MODULUS * (total - before)

    out = part_ptr + c * 3
    tl.store(out, total)
    tl.store(out + 1, weighted)
    tl.store(out + 2, flag)


def launch(frames: list[Tensor], desc: Tensor) -> Tensor:
    """Partials [chunks, 3] int64 (byte sum, weighted sum, flag) of every chunk of every frame, in
    one launch: row r of `desc` [chunks, 5] int64 (on the frames' device) is a chunk of frame
    `desc[r, 4]`. No host sync: the frames' addresses go up through a pinned staging copy."""
    part = torch.empty((desc.shape[0], 3), dtype=torch.int64, device=desc.device)
    if desc.shape[0] == 0:
        return part
    addrs = torch.tensor([f.data_ptr() for f in frames], dtype=torch.int64)
    if desc.device.type == "cuda":
        addrs = addrs.pin_memory().to(desc.device, non_blocking=True)
    _scan_kernel[(desc.shape[0],)](addrs, desc, part, WB=WORDS, ITERS=ITERS, num_warps=NUM_WARPS)
    return part
