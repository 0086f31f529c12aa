"""Bucket planning keeps a weight with its scales and respects bucket_bytes; packing is bit-exact."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from skyq.sync.buckets import WireUnit, pack_bucket, plan_buckets, unpack_bucket
from skyq.sync.checksums import bucket_checksum
from skyq.sync.errors import SyncRefused
from skyq.sync.manifest import SyncManifest

from .wire_fixtures import raw_bytes, serialize_all

WIRE_DTYPES = [
    torch.float8_e4m3fn,
    torch.float8_e8m0fnu,
    torch.uint8,
    torch.int32,
    torch.bfloat16,
    torch.int64,
]


def _unit(i: int, sizes: list[int]) -> WireUnit:
    return WireUnit(
        source=f"u{i}", tensors={f"u{i}.t{j}": torch.zeros(n, dtype=torch.uint8) for j, n in enumerate(sizes)}
    )


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    unit_sizes=st.lists(st.lists(st.integers(1, 300), min_size=1, max_size=3), min_size=1, max_size=20),
    bucket_bytes=st.integers(1, 1000),
)
def test_buckets_respect_bucket_bytes_and_never_split_a_unit(unit_sizes, bucket_bytes):
    units = [_unit(i, sizes) for i, sizes in enumerate(unit_sizes)]
    buckets = plan_buckets(units, bucket_bytes)
    assert [u.source for b in buckets for u in b] == [u.source for u in units]  # order kept, none lost
    for bucket in buckets:
        size = sum(u.packed_bytes for u in bucket)
        # Only a unit that alone exceeds the limit may produce an oversized bucket.
        assert size <= bucket_bytes or len(bucket) == 1
        buf, entry = pack_bucket(0, bucket)
        assert buf.numel() == entry.nbytes <= size
    # Greedy: two neighbouring buckets could not have been merged.
    for left, right in zip(buckets, buckets[1:]):
        assert sum(u.packed_bytes for u in left) + right[0].packed_bytes > bucket_bytes


def test_weight_and_scales_share_a_bucket_even_with_tiny_buckets(gen):
    wire = serialize_all(
        {
            "model.layers.0.self_attn.q_proj.weight": torch.randn(16, 8, generator=gen).bfloat16(),
            "model.layers.0.mlp.experts.1.down_proj.weight": torch.randn(8, 16, generator=gen).bfloat16(),
        }
    )
    units = [WireUnit(source=n, tensors=w) for n, w in wire.items()]
    buckets = plan_buckets(units, bucket_bytes=1)
    assert len(buckets) == 2
    manifest = SyncManifest(version=1, buckets=tuple(pack_bucket(i, b)[1] for i, b in enumerate(buckets)))
    manifest.validate()
    for bucket in manifest.buckets:
        assert len({t.unit for t in bucket.tensors}) == 1
        assert len(bucket.tensors) in (2, 3)  # weight + scale_inv; packed + scale + shape


@pytest.mark.parametrize("dtype", WIRE_DTYPES, ids=str)
def test_pack_unpack_is_bit_identical_for_every_wire_dtype(gen, dtype):
    raw = torch.randint(0, 256, (7 * 13 * 8,), generator=gen, dtype=torch.uint8)
    if dtype == torch.float8_e4m3fn:
        raw = torch.where((raw & 0x7F) == 0x7F, raw ^ 1, raw)  # no NaN codes
    t = raw.view(dtype).reshape(7, 13, -1)[:, 1:, :]  # a non-contiguous view
    odd = torch.randn(3, generator=gen).to(torch.bfloat16)  # misaligns what follows unless padded
    unit = WireUnit(source="w", tensors={"w.odd": odd, "w.t": t})
    buf, entry = pack_bucket(0, [unit])
    out = unpack_bucket(buf, entry, verify_checksum=True)
    assert out["w.t"].dtype == dtype and out["w.t"].shape == t.shape
    assert raw_bytes(out["w.t"]) == raw_bytes(t.contiguous())
    assert raw_bytes(out["w.odd"]) == raw_bytes(odd)
    assert out["w.t"].data_ptr() != buf.data_ptr()  # a copy, not a view of the transport buffer


def test_a_flipped_bit_fails_the_checksum_naming_the_bucket(gen):
    unit = WireUnit(source="w", tensors={"w": torch.randn(64, generator=gen)})
    buf, entry = pack_bucket(3, [unit])
    corrupted = buf.clone()
    corrupted[17] ^= 0x10
    assert bucket_checksum(corrupted) != entry.checksum
    with pytest.raises(SyncRefused, match=r"bucket 3 \(holding w\) arrived corrupted"):
        unpack_bucket(corrupted, entry, verify_checksum=True)


def test_bucket_bytes_below_one_is_refused():
    with pytest.raises(SyncRefused, match="bucket_bytes=0"):
        plan_buckets([_unit(0, [4])], 0)
