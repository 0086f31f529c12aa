"""A repeat sync of an unchanged layout sends only "same layout as version N, digest D" and the
checksums: it delivers the same bytes as a full sync, a changed layout goes in full, and a receiver
that does not hold the named layout refuses it and commits nothing."""

from __future__ import annotations

import json
import re
import threading

import pytest
import torch

from skyq.sync.errors import SyncError, SyncRefused
from skyq.sync.in_process import in_process_pair
from skyq.sync.receiver import ExpectedUnit, WeightReceiver
from skyq.sync.sender import WeightSender

from .test_batched_sync import Serializer
from .test_sync_in_process import Flaky
from .wire_fixtures import DictEngine, expected_units, fp8_like_serialize, random_weights, serialize_all


class Link:
    """One sender and one receiver kept across syncs on one in-process channel, as actors keep them."""

    def __init__(self, expected, *, serialize=fp8_like_serialize, bucket_bytes=256, wrap=None) -> None:
        send_end, self.recv_end = in_process_pair(timeout_s=5.0)
        self.send_end = wrap(send_end) if wrap is not None else send_end
        self.sender = WeightSender(self.send_end, serialize=serialize, bucket_bytes=bucket_bytes)
        self.receiver = WeightReceiver(self.recv_end, expected, verify_checksum=True)
        self.engine = DictEngine()

    def sync(self, items, version):
        """(stats, None) or (None, the sender's error); the receiver must fail alike."""
        errors: list[BaseException] = []

        def receive():
            try:
                self.receiver.receive(current_version=self.engine.version, commit=self.engine.commit)
            except SyncError as exc:
                errors.append(exc)

        thread = threading.Thread(target=receive)
        thread.start()
        try:
            stats, send_err = self.sender.sync(items, version), None
        except SyncError as exc:
            stats, send_err = None, exc
        thread.join(timeout=10)
        assert not thread.is_alive()
        assert (send_err is None) == (not errors), (send_err, errors)
        return stats, send_err


def fresh_like(weights, gen):
    return {n: torch.randn(t.shape, generator=gen).to(t.dtype) for n, t in weights.items()}


def wire_bytes(wire):
    return {n: t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() for n, t in wire.items()}


def test_a_same_layout_sync_delivers_bit_identical_weights(gen):
    weights = random_weights(gen)
    link = Link(expected_units(weights))
    first, _ = link.sync(weights.items(), 1)
    assert first.full_manifest and first.num_buckets > 1
    for version in (2, 3):
        weights = fresh_like(weights, gen)
        stats, err = link.sync(weights.items(), version)
        assert err is None and not stats.full_manifest
        assert (stats.num_tensors, stats.bytes, stats.num_buckets) == (
            first.num_tensors,
            first.bytes,
            first.num_buckets,
        )
        want = {n: t for wire in serialize_all(weights).values() for n, t in wire.items()}
        assert link.engine.snapshot() == (version, wire_bytes(want))


def test_a_same_layout_sync_of_expert_stacks_matches_serializing_each_expert(gen):
    names = tuple(f"model.layers.0.mlp.experts.{i}.up_proj.weight" for i in range(5))
    ser = Serializer()

    def per_tensor(stack):
        return {w: t for i, n in enumerate(names) for w, t in ser(n, stack[i]).items()}

    stack = (torch.randn(5, 128, 384, generator=gen) * 0.02).to(torch.bfloat16)
    expected = [
        ExpectedUnit(source=n, tensors={w: (tuple(t.shape), t.dtype) for w, t in ser(n, stack[i]).items()})
        for i, n in enumerate(names)
    ]
    link = Link(expected, serialize=ser, bucket_bytes=3 * 128 * 384)
    assert link.sync([(names, stack)], 1)[0].full_manifest
    stack = (torch.randn(5, 128, 384, generator=gen) * 0.02).to(torch.bfloat16)
    stats, _ = link.sync([(names, stack)], 2)
    assert not stats.full_manifest and stats.num_buckets == 3  # 2 + 2 + 1 experts
    assert link.engine.snapshot() == (2, wire_bytes(per_tensor(stack)))


def test_a_changed_order_goes_as_a_full_manifest_and_still_commits(gen):
    weights = random_weights(gen)
    link = Link(expected_units(weights))
    link.sync(weights.items(), 1)
    reordered = dict(reversed(list(fresh_like(weights, gen).items())))
    stats, err = link.sync(reordered.items(), 2)
    assert err is None and stats.full_manifest
    want = {n: t for wire in serialize_all(reordered).values() for n, t in wire.items()}
    assert link.engine.snapshot() == (2, wire_bytes(want))
    assert link.sync(fresh_like(weights, gen).items(), 3)[0].full_manifest  # the original order again
    assert not link.sync(fresh_like(weights, gen).items(), 4)[0].full_manifest


def test_a_changed_shape_or_name_set_goes_as_a_full_manifest_and_the_plan_check_refuses_it(gen):
    weights = random_weights(gen)
    link = Link(expected_units(weights))
    link.sync(weights.items(), 1)
    before = link.engine.snapshot()
    reshaped = fresh_like(weights, gen)
    reshaped["model.norm.weight"] = torch.randn(9, generator=gen).to(torch.bfloat16)
    _, err = link.sync(reshaped.items(), 2)
    # Only a full manifest names each tensor's shape: the engine's plan check is what refused it.
    assert isinstance(err, SyncRefused) and "`model.norm.weight` arrived as bfloat16[9]" in str(err)
    dropped = {n: t for n, t in fresh_like(weights, gen).items() if n != "model.norm.weight"}
    _, err = link.sync(dropped.items(), 2)
    assert isinstance(err, SyncRefused) and "`model.norm.weight` was dropped" in str(err)
    assert link.engine.snapshot() == before
    stats, err = link.sync(fresh_like(weights, gen).items(), 2)
    assert err is None and stats.full_manifest  # a refused sync leaves no cached layout behind
    assert not link.sync(fresh_like(weights, gen).items(), 3)[0].full_manifest


def test_a_receiver_without_the_layout_refuses_a_same_layout_sync_and_commits_nothing(gen):
    weights = random_weights(gen)
    link = Link(expected_units(weights))
    link.sync(weights.items(), 1)
    link.sync(fresh_like(weights, gen).items(), 2)
    # The engine side restarts its receiver (a new one holds no layout); the sender does not know.
    link.receiver = WeightReceiver(link.recv_end, expected_units(weights), verify_checksum=True)
    before = link.engine.snapshot()
    _, err = link.sync(fresh_like(weights, gen).items(), 3)
    assert isinstance(err, SyncRefused)
    assert re.search(
        r"weight version 3 refers to the layout of version 1 \(digest sha256:[0-9a-f]+", str(err)
    )
    assert "holds no layout" in str(err) and "nothing was committed" in str(err)
    assert link.engine.snapshot() == before
    stats, err = link.sync(fresh_like(weights, gen).items(), 3)
    assert err is None and stats.full_manifest and link.engine.version == 3


class RewriteLayout:
    """A channel end that rewrites one key of every same-layout message it sends."""

    def __init__(self, inner, key, value) -> None:
        self.inner, self.key, self.value = inner, key, value

    def send_frame(self, payload):
        raw = payload.numpy().tobytes()
        if b'"same_layout_as"' in raw:
            obj = json.loads(raw)
            obj[self.key] = self.value
            payload = torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)
        self.inner.send_frame(payload)

    def recv_frame(self, max_bytes, what):
        return self.inner.recv_frame(max_bytes, what)

    def close(self):
        self.inner.close()


@pytest.mark.parametrize(
    ("key", "value", "named"),
    [
        ("layout", "sha256:" + "0" * 64, r"digest sha256:0000000000000000"),
        ("same_layout_as", 7, r"layout of version 7"),
    ],
)
def test_a_stale_or_unknown_layout_digest_is_refused_naming_it_and_commits_nothing(gen, key, value, named):
    weights = random_weights(gen)
    link = Link(expected_units(weights), wrap=lambda end: RewriteLayout(end, key, value))
    link.sync(weights.items(), 1)
    before = link.engine.snapshot()
    _, err = link.sync(fresh_like(weights, gen).items(), 2)
    assert isinstance(err, SyncRefused) and re.search(named, str(err)), str(err)
    assert "the engine holds the layout of version 1" in str(err)
    assert link.engine.snapshot() == before
    stats, err = link.sync(fresh_like(weights, gen).items(), 2)  # both sides dropped the layout
    assert err is None and stats.full_manifest


def test_a_corrupted_bucket_of_a_same_layout_sync_is_refused_and_the_next_sync_goes_in_full(gen):
    weights = random_weights(gen)
    link = Link(expected_units(weights), wrap=lambda end: Flaky(end, corrupt_frame=10**9))
    link.sync(weights.items(), 1)
    before = link.engine.snapshot()
    link.send_end.corrupt_frame = link.send_end.sent + 2  # the second bucket of the next sync
    _, err = link.sync(fresh_like(weights, gen).items(), 2)
    assert isinstance(err, SyncRefused) and "arrived corrupted" in str(err)
    assert link.engine.snapshot() == before
    stats, err = link.sync(fresh_like(weights, gen).items(), 2)
    assert err is None and stats.full_manifest
