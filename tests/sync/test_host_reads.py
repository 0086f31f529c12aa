"""The device values a sync checks are read back together: checksum sums with the value flags
(`PendingChecksums.read(extra=...)`), and a bad value is refused naming its tensor, by the sender
(its scan of what it packed) and by the receiver (a peer that sent it anyway)."""

from __future__ import annotations

import threading

import pytest
import torch

from skyq.sync.channel import recv_json, send_bytes
from skyq.sync.checksums import BLAKE2B, WSUM64, PendingChecksums, bucket_checksum, bucket_checksums
from skyq.sync.errors import SyncError, SyncRefused, SyncTimeout
from skyq.sync.in_process import in_process_pair
from skyq.sync.layout import SenderLayout
from skyq.sync.receiver import WeightReceiver
from skyq.sync.sender import WeightSender, serialize_unit

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
    """`fp8_like_serialize` with one bad wire value from finite inputs."""

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


def _name(kind: str) -> str:
    return "model.layers.0.self_attn.q_proj.weight" if kind == "e4m3 NaN code" else "model.norm.weight"


@pytest.mark.parametrize("kind", ["e4m3 NaN code", "bf16 inf"])
def test_the_sender_refuses_a_bad_wire_value_naming_it_and_sends_nothing(gen, kind):
    """The inputs are finite; the bad value appears in what the serializer produced, and the
    sender's value check of its packed buckets (`scan.PendingScan`) finds it."""
    weights = random_weights(gen)
    send_end, recv_end = in_process_pair(timeout_s=0.2)
    with pytest.raises(SyncRefused, match="refused before sending anything") as refused:
        WeightSender(send_end, serialize=_bad_wire(kind), bucket_bytes=256).sync(weights.items(), 1)
    assert _name(kind) in str(refused.value)
    with pytest.raises(SyncTimeout):  # not a single frame (nor the manifest) left the sender
        recv_end.recv_frame(1 << 20, "anything")


@pytest.mark.parametrize("verify_checksum", [True, False])
@pytest.mark.parametrize("kind", ["e4m3 NaN code", "bf16 inf"])
def test_a_bad_received_value_is_refused_naming_it_with_or_without_checksums(gen, verify_checksum, kind):
    """A peer that does not check what it sends: the sync is packed and sent by hand here (the
    sender's real layout, buckets, checksums and manifest), and the receiver refuses it."""
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
    serialize = _bad_wire(kind)
    items = [serialize_unit(name, t, serialize, 1, check=False) for name, t in weights.items()]
    layout = SenderLayout.build(items, bucket_bytes=256, version=1)
    bufs = layout.pack(items)
    send_bytes(send_end, layout.manifest(1, bucket_checksums(bufs)).to_json_bytes(layout.digest))
    assert recv_json(send_end, "manifest ack")["ok"] is True
    for buf in bufs:
        send_end.send_frame(buf)
    ack = recv_json(send_end, "commit ack")
    thread.join(timeout=10)
    assert ack["ok"] is False and "unusable" in ack["error"] and _name(kind) in ack["error"]
    assert _name(kind) in str(errors["recv"])
    assert engine.version == 0 and engine.wire == {}
    # The same pair then commits a good sync.
    thread = threading.Thread(target=receive)
    errors.clear()
    thread.start()
    WeightSender(send_end, serialize=fp8_like_serialize, bucket_bytes=256).sync(weights.items(), 1)
    thread.join(timeout=10)
    assert not errors and engine.version == 1
