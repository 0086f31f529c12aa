"""The device values a sync checks are read back together: checksum sums with the value flags
(`PendingChecksums.read(extra=...)`), and a bad value is still refused naming its tensor."""

from __future__ import annotations

import threading

import pytest
import torch

from skyq.sync.checksums import BLAKE2B, WSUM64, PendingChecksums, bucket_checksum
from skyq.sync.errors import SyncError, SyncRefused
from skyq.sync.in_process import in_process_pair
from skyq.sync.receiver import WeightReceiver
from skyq.sync.sender import WeightSender

from .wire_fixtures import DictEngine, expected_units, fp8_like_serialize, random_weights


def test_pending_checksums_equal_one_by_one_checksums_and_read_the_extra_values(gen):
    bufs = [torch.randint(0, 256, (n,), generator=gen, dtype=torch.uint8) for n in (1, 70_000, 65521, 300)]
    algorithms = [WSUM64, BLAKE2B, WSUM64, None]
    extra = torch.tensor([False, True, False])
    got, values = PendingChecksums(bufs, algorithms).read(extra=extra)
    assert got == [bucket_checksum(b, a) for b, a in zip(bufs, algorithms)]
    assert values == [0, 1, 0]
    # No wsum64 sum on the extra's device: it is read on its own.
    got, values = PendingChecksums(bufs[1:2], [BLAKE2B]).read(extra=torch.tensor([3, 0]))
    assert got == [bucket_checksum(bufs[1], BLAKE2B)] and values == [3, 0]
    one_by_one = [bucket_checksum(b, a) for b, a in zip(bufs, algorithms)]
    assert PendingChecksums(bufs, algorithms).read() == (one_by_one, [])


def _bad_wire(kind: str):
    """`fp8_like_serialize` with one bad wire value the sender does not look at (it checks inputs)."""

    def serialize(name, t):
        wire = fp8_like_serialize(name, t)
        if kind == "e4m3 NaN code" and "q_proj" in name:
            codes = wire[name].clone()
            codes.view(torch.uint8)[1, 2] = 0x7F
            wire[name] = codes
        if kind == "bf16 inf" and name == "model.norm.weight":
            wire[name] = wire[name].clone()
            wire[name][3] = float("inf")
        return wire

    return serialize


@pytest.mark.parametrize("verify_checksum", [True, False])
@pytest.mark.parametrize("kind", ["e4m3 NaN code", "bf16 inf"])
def test_a_bad_received_value_is_refused_naming_it_with_or_without_checksums(gen, verify_checksum, kind):
    weights = random_weights(gen)
    engine = DictEngine()
    send_end, recv_end = in_process_pair(timeout_s=5.0)
    receiver = WeightReceiver(recv_end, expected_units(weights), verify_checksum=verify_checksum)
    errors: dict[str, SyncError] = {}

    def receive():
        try:
            receiver.receive(current_version=0, commit=engine.commit)
        except SyncError as exc:
            errors["recv"] = exc

    thread = threading.Thread(target=receive)
    thread.start()
    sender = WeightSender(send_end, serialize=_bad_wire(kind), bucket_bytes=256)
    with pytest.raises(SyncRefused, match="unusable") as refused:
        sender.sync(weights.items(), 1)
    thread.join(timeout=10)
    name = "q_proj.weight" if kind == "e4m3 NaN code" else "model.norm.weight"
    assert name in str(refused.value) and name in str(errors["recv"])
    assert engine.version == 0 and engine.wire == {}
    # The same pair then commits a good sync.
    thread = threading.Thread(target=receive)
    errors.clear()
    thread.start()
    WeightSender(send_end, serialize=fp8_like_serialize, bucket_bytes=256).sync(weights.items(), 1)
    thread.join(timeout=10)
    assert not errors and engine.version == 1
