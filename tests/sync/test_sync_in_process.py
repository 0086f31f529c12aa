"""The sync protocol end to end over the in-process transport: every bad sync is refused and leaves
the engine's weights and version exactly as they were."""

from __future__ import annotations

import re
import threading
import time

import pytest
import torch

from skyq.sync.errors import SyncError, SyncRefused, SyncTimeout
from skyq.sync.in_process import in_process_pair
from skyq.sync.receiver import WeightReceiver
from skyq.sync.sender import WeightSender

from .wire_fixtures import (
    DictEngine,
    expected_units,
    fp8_like_serialize,
    random_weights,
    raw_bytes,
    serialize_all,
)


class Flaky:
    """A channel end that corrupts the n-th frame it sends (a byte flip in transit)."""

    def __init__(self, inner, corrupt_frame: int) -> None:
        self.inner, self.corrupt_frame, self.sent = inner, corrupt_frame, 0

    def send_frame(self, payload):
        if self.sent == self.corrupt_frame:
            payload = payload.clone()
            payload[payload.numel() // 2] ^= 0x01
        self.sent += 1
        self.inner.send_frame(payload)

    def recv_frame(self, max_bytes, what):
        return self.inner.recv_frame(max_bytes, what)

    def close(self):
        self.inner.close()


def run_sync(
    weights, engine, version, *, expected, serialize=fp8_like_serialize, bucket_bytes=256, wrap=None
):
    """Sender in this thread, receiver in another; returns (sender error, receiver error, stats)."""
    send_end, recv_end = in_process_pair(timeout_s=5.0)
    if wrap is not None:
        send_end = wrap(send_end)
    receiver = WeightReceiver(recv_end, expected, verify_checksum=True)
    result: dict = {}

    def receive():
        try:
            result["recv"] = receiver.receive(current_version=engine.version, commit=engine.commit)
        except SyncError as exc:
            result["recv_err"] = exc

    thread = threading.Thread(target=receive)
    thread.start()
    try:
        stats = WeightSender(send_end, serialize=serialize, bucket_bytes=bucket_bytes).sync(
            weights.items(), version
        )
        send_err = None
    except SyncError as exc:
        stats, send_err = None, exc
    thread.join(timeout=10)
    assert not thread.is_alive()
    return send_err, result.get("recv_err"), stats


@pytest.fixture
def synced(gen):
    """An engine that already committed version 1 of `weights`."""
    weights = random_weights(gen)
    engine = DictEngine()
    send_err, recv_err, stats = run_sync(weights, engine, 1, expected=expected_units(weights))
    assert send_err is None and recv_err is None
    return weights, engine


def test_synced_wire_is_bit_identical_to_what_the_serializer_produced(synced):
    weights, engine = synced
    assert engine.version == 1
    serialized = {n: t for wire in serialize_all(weights).values() for n, t in wire.items()}
    assert set(engine.wire) == set(serialized)
    for name, t in serialized.items():
        assert engine.wire[name].dtype == t.dtype and engine.wire[name].shape == t.shape
        assert raw_bytes(engine.wire[name]) == raw_bytes(t), name


def test_stats_account_for_bytes_and_phases(gen):
    weights = random_weights(gen)
    engine = DictEngine()
    _, _, stats = run_sync(weights, engine, 1, expected=expected_units(weights), bucket_bytes=200)
    wire_bytes = sum(
        t.numel() * t.element_size() for w in serialize_all(weights).values() for t in w.values()
    )
    assert stats.num_tensors == len(engine.wire) == 9
    assert wire_bytes <= stats.bytes < wire_bytes + 16 * stats.num_tensors  # only alignment padding on top
    assert stats.num_buckets > 1
    assert all(v >= 0 for v in (stats.gather_s, stats.quantize_s, stats.transfer_s, stats.load_s))
    assert stats.total_s >= stats.quantize_s + stats.load_s
    assert set(stats.as_metrics()) >= {
        "sync/bytes",
        "sync/gather_s",
        "sync/quantize_s",
        "sync/transfer_s",
        "sync/load_s",
    }


def _drop(wire_name):
    def serialize(name, t):
        return {n: w for n, w in fp8_like_serialize(name, t).items() if n != wire_name}

    return serialize


def _rename_unknown(name, t):
    wire = fp8_like_serialize(name, t)
    if name == "model.norm.weight":
        return {"model.norm.bias": wire[name]}
    return wire


BAD_SYNCS = {
    # case: (run_sync overrides, source tensor the trainer leaves out, version sent, expected message)
    "dropped tensor": ({}, "model.norm.weight", 3, "`model.norm.weight` was dropped"),
    "unknown name": (dict(serialize=_rename_unknown), None, 3, "unknown tensor `model.norm.bias`"),
    "scale without its weight": (
        dict(serialize=_drop("model.layers.0.self_attn.q_proj.weight")),
        None,
        3,
        r"received \['model.layers.0.self_attn.q_proj.weight_scale_inv'\] without "
        r"\['model.layers.0.self_attn.q_proj.weight'\]",
    ),
    "duplicate version": ({}, None, 2, "weight version 2 is a duplicate version"),
    "older version": (
        {},
        None,
        1,
        "weight version 1 is an older version: the engine already holds version 2",
    ),
    "checksum mismatch": (dict(wrap=lambda end: Flaky(end, corrupt_frame=2)), None, 3, "arrived corrupted"),
}


@pytest.mark.parametrize("case", BAD_SYNCS, ids=list(BAD_SYNCS))
def test_bad_sync_is_refused_and_leaves_the_engine_unchanged(synced, gen, case):
    weights, engine = synced
    expected = expected_units(weights)
    assert run_sync(weights, engine, 2, expected=expected)[:2] == (None, None)
    before = engine.snapshot()
    overrides, left_out, version, message = BAD_SYNCS[case]
    fresh = {n: torch.randn(t.shape, generator=gen).to(t.dtype) for n, t in weights.items() if n != left_out}
    send_err, recv_err, _ = run_sync(fresh, engine, version, expected=expected, **overrides)
    assert isinstance(send_err, SyncRefused) and isinstance(recv_err, SyncRefused)
    for err in (send_err, recv_err):
        assert re.search(message, str(err)), str(err)
    assert engine.snapshot() == before
    # The protocol stays aligned after a refusal: the next good sync goes through.
    fresh = {n: torch.randn(t.shape, generator=gen).to(t.dtype) for n, t in weights.items()}
    assert run_sync(fresh, engine, 3, expected=expected)[:2] == (None, None)
    assert engine.version == 3


def test_nan_weight_is_refused_at_the_sender_naming_it_and_nothing_is_sent(gen):
    weights = random_weights(gen)
    weights["model.layers.0.mlp.experts.1.down_proj.weight"][3, 5] = float("nan")
    send_end, recv_end = in_process_pair(timeout_s=0.2)
    with pytest.raises(SyncRefused, match=r"model\.layers\.0\.mlp\.experts\.1\.down_proj\.weight: 1 NaN"):
        WeightSender(send_end, serialize=fp8_like_serialize, bucket_bytes=1024).sync(weights.items(), 1)
    with pytest.raises(SyncTimeout):  # not a single frame left the sender
        recv_end.recv_frame(1 << 20, "anything")


def test_receiver_without_a_sender_times_out_within_its_deadline(gen):
    _, recv_end = in_process_pair(timeout_s=0.3)
    engine = DictEngine()
    start = time.monotonic()
    with pytest.raises(SyncTimeout, match="timeout_s"):
        WeightReceiver(recv_end, expected_units(random_weights(gen)), verify_checksum=True).receive(
            current_version=0, commit=engine.commit
        )
    assert time.monotonic() - start < 2.0
    assert engine.version == 0 and engine.wire == {}


def test_a_failing_commit_is_reported_to_the_sender(gen):
    weights = random_weights(gen)
    engine = DictEngine()

    def refusing_commit(wire, version):
        raise ValueError("engine plan mismatch on `model.norm.weight`")

    engine.commit = refusing_commit
    send_err, recv_err, _ = run_sync(weights, engine, 1, expected=expected_units(weights))
    for err in (send_err, recv_err):
        assert isinstance(err, SyncRefused) and "engine plan mismatch on `model.norm.weight`" in str(err)


def test_an_abort_wakes_the_waiting_peer_at_once():
    """A side that gives up tells its peer, whose receive fails now with the reason, not at its deadline."""
    sender, receiver = in_process_pair(timeout_s=600.0)
    sender.abort("RefusedError: w is not finite")
    with pytest.raises(SyncError, match="manifest: the sender gave up: RefusedError: w is not finite"):
        receiver.recv_frame(1024, "manifest")


def test_a_given_frame_arrives_uncopied_and_a_sent_one_as_a_copy():
    """`give_frame` hands the tensor itself to the receiver (no copy of every synced byte, and the
    buckets are not held twice); `send_frame` delivers a copy the sender may go on writing."""
    sender, receiver = in_process_pair(timeout_s=5.0)
    given, sent = torch.arange(10, dtype=torch.uint8), torch.arange(10, dtype=torch.uint8)
    sender.give_frame(given)
    sender.send_frame(sent)
    got_given, got_sent = receiver.recv_frame(64, "a"), receiver.recv_frame(64, "b")
    assert got_given.data_ptr() == given.data_ptr()
    sent.fill_(7)
    assert got_sent.data_ptr() != sent.data_ptr() and got_sent.tolist() == list(range(10))


@pytest.mark.parametrize("wrapped", [False, True])
def test_the_sender_hands_its_buckets_over_and_wrappers_without_give_frame_still_send(gen, wrapped):
    """A weight sync's buckets are made for it and never written after sending: the sender gives
    them to a channel that can take them (`channel.give_frame`), and sends them to one that cannot
    (a wrapper with only `send_frame`), with the same weights delivered either way."""
    weights = random_weights(gen)
    expected = expected_units(weights)
    send_end, recv_end = in_process_pair(timeout_s=5.0)
    calls: list[int] = []
    inner_give = send_end.give_frame
    send_end.give_frame = lambda payload: calls.append(payload.numel()) or inner_give(payload)
    channel = Flaky(send_end, corrupt_frame=10**9) if wrapped else send_end
    engine = DictEngine()
    receiver = WeightReceiver(recv_end, expected, verify_checksum=True)
    thread = threading.Thread(target=lambda: receiver.receive(current_version=0, commit=engine.commit))
    thread.start()
    stats = WeightSender(channel, serialize=fp8_like_serialize, bucket_bytes=256).sync(weights.items(), 1)
    thread.join(timeout=10)
    assert len(calls) == (0 if wrapped else stats.num_buckets)
    want = {n: raw_bytes(t) for wire in serialize_all(weights).values() for n, t in wire.items()}
    assert engine.snapshot() == (1, want)
