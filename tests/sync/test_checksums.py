"""Bucket checksums catch corrupted bytes; wsum64 is the same number on any device and chunking."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from skyq.sync.buckets import WireUnit, pack_bucket, unpack_bucket
from skyq.sync.checksums import BLAKE2B, WSUM64, bucket_checksum, checksum_algorithm, wsum64
from skyq.sync.errors import SyncRefused


def corruptions(buf: torch.Tensor, gen: torch.Generator) -> dict[str, torch.Tensor]:
    n = buf.numel()
    i, j = sorted(torch.randint(0, n, (2,), generator=gen).tolist())
    flipped = buf.clone()
    flipped[i] ^= 1 << int(torch.randint(0, 8, (1,), generator=gen))
    zeroed = buf.clone()
    zeroed[i : max(j, i + 1)] = 0
    shifted = torch.cat([buf[1:], buf[:1]])
    return {"bit flip": flipped, "zeroed range": zeroed, "truncated": buf[:-1], "shifted": shifted}


@pytest.mark.parametrize("algorithm", [BLAKE2B, WSUM64])
def test_every_corruption_changes_the_checksum(gen, algorithm):
    for _ in range(20):
        buf = torch.randint(
            1, 256, (int(torch.randint(2, 5000, (1,), generator=gen)),), generator=gen, dtype=torch.uint8
        )
        good = bucket_checksum(buf, algorithm)
        assert checksum_algorithm(good) == algorithm
        for what, bad in corruptions(buf, gen).items():
            if torch.equal(bad, buf):
                continue  # e.g. a rotation of a constant buffer
            assert bucket_checksum(bad, algorithm) != good, what


def test_wsum64_does_not_depend_on_chunking(gen):
    buf = torch.randint(0, 256, (100_003,), generator=gen, dtype=torch.uint8)
    assert wsum64(buf) == wsum64(buf, chunk_bytes=7) == wsum64(buf, chunk_bytes=65521)


def test_the_receiver_recomputes_the_algorithm_the_manifest_names(gen):
    unit = WireUnit(source="w", tensors={"w": torch.randn(300, generator=gen)})
    buf, entry = pack_bucket(0, [unit])
    assert entry.checksum.startswith(f"{BLAKE2B}:")  # a CPU bucket
    as_wsum = dataclasses.replace(entry, checksum=bucket_checksum(buf, WSUM64))
    assert torch.equal(unpack_bucket(buf, as_wsum, verify_checksum=True)["w"], unit.tensors["w"])
    corrupted = buf.clone()
    corrupted[5] ^= 0x80
    with pytest.raises(SyncRefused, match="arrived corrupted"):
        unpack_bucket(corrupted, as_wsum, verify_checksum=True)
    with pytest.raises(SyncRefused, match="names no known algorithm"):
        unpack_bucket(buf, dataclasses.replace(entry, checksum="md5:abc"), verify_checksum=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_wsum64_on_a_gpu_equals_the_cpu_value(gen):
    buf = torch.randint(0, 256, ((1 << 24) + 12345,), generator=gen, dtype=torch.uint8)
    assert bucket_checksum(buf.cuda()) == bucket_checksum(buf, WSUM64)
    assert bucket_checksum(buf.cuda()).startswith(f"{WSUM64}:")


def _wsum64_by_definition(buf: torch.Tensor) -> str:
    b = buf.to(torch.int64)
    w = torch.arange(b.numel(), dtype=torch.int64) % 65521 + 1
    mask = (1 << 64) - 1
    return f"{b.numel():x}-{int(b.sum()) & mask:016x}{int((b * w).sum()) & mask:016x}"


@pytest.mark.parametrize("rows,tail", [(0, 5), (1, 0), (127, 3), (128, 0), (128, 7), (300, 11)])
def test_wsum64_matches_its_definition_across_row_groups(gen, rows, tail):
    """The column sums go through int16 in groups of 128 rows of 65521 bytes: every whole group,
    a partial one and the tail add up to the exact sums, all-255 bytes (the int16 worst case) too."""
    n = rows * 65521 + tail
    buf = torch.randint(0, 256, (n,), generator=gen, dtype=torch.uint8)
    assert wsum64(buf) == _wsum64_by_definition(buf) == wsum64(buf, chunk_bytes=65521 * 129)
    full = torch.full((n,), 255, dtype=torch.uint8)
    assert wsum64(full) == _wsum64_by_definition(full) == wsum64(full, chunk_bytes=7)
