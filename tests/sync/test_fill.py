"""A repeat sync fills its buckets in place (`skyq.sync.fill`): the quantizers write into the bucket
bytes, the rest is copied there, and the bytes are exactly what serializing and packing would have
sent, for every format, with stacks that span buckets and padding between tensors. A sync whose
items changed is serialized and packed as before; a bad value is refused by name with nothing sent."""

from __future__ import annotations

import threading

import pytest
import torch

from skyq.config.enums import Precision
from skyq.config.schema import ModelConfig, PrecisionConfig
from skyq.quant.plan import build_plan
from skyq.quant.strategies import get_strategy
from skyq.sync.errors import SyncError, SyncRefused, SyncTimeout
from skyq.sync.fill import FillPlan, copy_into
from skyq.sync.in_process import in_process_pair
from skyq.sync.layout import SenderLayout
from skyq.sync.plan_wire import expected_units, plan_serializer
from skyq.sync.receiver import ExpectedUnit, WeightReceiver
from skyq.sync.sender import WeightSender, _build_items, _collect, _fill

from .wire_fixtures import DictEngine
from .wire_fixtures import raw_bytes as raw

FORMATS = ["bf16", "fp8_blockwise", "mxfp8", "int4_qat"]


def tiny_model() -> ModelConfig:
    """Odd sizes on purpose: per-expert fp8 scales of 4 bytes and head norms of 40 bytes leave
    padding between members, which the fill must zero and route around."""
    return ModelConfig(
        name="tiny_moe", hidden_size=64, num_layers=2, num_attention_heads=2, num_key_value_heads=1,
        head_dim=20, moe_intermediate_size=32, intermediate_size=96, num_experts=6, num_experts_per_tok=2,
        vocab_size=40,
    )  # fmt: skip


def trainer_items(plan, gen, *, scale: float = 0.05, device: str = "cpu") -> list:
    """The plan's tensors as a trainer yields them: dense (name, tensor), each projection's experts
    as one (names, [E, N, K] stack)."""
    stacks: dict[tuple[str, str], list] = {}
    items: list = []
    for p in plan:
        if ".mlp.experts." in p.name:
            prefix, rest = p.name.split(".mlp.experts.")
            key = (prefix, rest.split(".", 1)[1])
            if key not in stacks:
                stacks[key] = []
                items.append(("stack", key))
            stacks[key].append(p)
        else:
            items.append(("dense", p))
    out = []
    for kind, item in items:
        if kind == "stack":
            members = stacks[item]
            stack = (torch.randn(len(members), *members[0].shape, generator=gen) * scale).to(torch.bfloat16)
            out.append((tuple(m.name for m in members), stack.to(device)))
        else:
            t = (torch.randn(item.shape, generator=gen) * scale).to(torch.bfloat16)
            out.append((item.name, t.to(device)))
    return out


class Pair:
    def __init__(self, fmt: str, bucket_bytes: int) -> None:
        precision = PrecisionConfig(name=Precision(fmt))
        self.plan = build_plan(tiny_model(), precision)
        self.serialize = plan_serializer(get_strategy(precision), self.plan)
        self.send_end, recv_end = in_process_pair(timeout_s=10.0)
        self.sender = WeightSender(self.send_end, serialize=self.serialize, bucket_bytes=bucket_bytes)
        self.receiver = WeightReceiver(recv_end, expected_units(self.plan), verify_checksum=True)
        self.engine = DictEngine()

    def sync(self, items, version):
        errors: list[BaseException] = []

        def receive():
            try:
                self.receiver.receive(current_version=self.engine.version, commit=self.engine.commit)
            except SyncError as exc:
                errors.append(exc)

        thread = threading.Thread(target=receive)
        thread.start()
        try:
            return self.sender.sync(items, version), errors
        except SyncError:
            self.send_end.abort("the test's sender refused")  # the receiver stops waiting at once
            raise
        finally:
            thread.join(timeout=20)


def per_tensor_wire(serialize, items) -> dict[str, bytes]:
    out = {}
    for name, t in items:
        pairs = [(name, t)] if isinstance(name, str) else list(zip(name, t.unbind(0)))
        for n, member in pairs:
            for wname, w in serialize(n, member).items():
                out[wname] = w.contiguous().reshape(-1).view(torch.uint8).cpu().numpy().tobytes()
    return out


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("bucket_bytes", [3000, 9000])
def test_a_repeat_sync_is_filled_in_place_and_commits_the_per_tensor_wire(gen, fmt, bucket_bytes):
    pair = Pair(fmt, bucket_bytes=bucket_bytes)  # every expert stack spans several buckets
    first, errors = pair.sync(trainer_items(pair.plan, gen), 1)
    assert not errors and first.full_manifest and not first.in_place and first.num_buckets > 4
    layout = pair.sender._layout
    assert layout is not None and layout.fill is not None and layout.sources is not None
    assert any(layout.fill.gaps), "the tiny model leaves padding between tensors"
    for version in (2, 3):
        items = trainer_items(pair.plan, gen)
        stats, errors = pair.sync(items, version)
        assert not errors and stats.in_place and not stats.full_manifest
        assert (stats.num_tensors, stats.bytes, stats.num_buckets) == (
            first.num_tensors,
            first.bytes,
            first.num_buckets,
        )
        version_held, wire = pair.engine.snapshot()
        assert version_held == version and wire == per_tensor_wire(pair.serialize, items)


@pytest.mark.parametrize("fmt", FORMATS)
def test_filled_buckets_equal_packed_buckets_byte_for_byte_padding_included(gen, fmt, device="cpu"):
    pair = Pair(fmt, bucket_bytes=2500)
    sources, _ = _collect(trainer_items(pair.plan, gen, device=device))
    items = _build_items(iter(sources), pair.serialize, 1, sources=[])[0]
    layout = SenderLayout.build(items, bucket_bytes=2500, version=1, sources=sources)
    packed = layout.pack(items)
    filled = _fill(layout, sources, pair.serialize, 1)
    assert filled is not None and len(filled) == len(packed)
    for b, (want, got) in enumerate(zip(packed, filled)):
        assert torch.equal(want, got), f"bucket {b}"


@pytest.mark.parametrize("fmt", ["fp8_blockwise", "bf16"])
def test_the_fill_plan_covers_every_bucket_byte_once(fmt):
    pair = Pair(fmt, bucket_bytes=9000)
    sources, _ = _collect(trainer_items(pair.plan, torch.Generator().manual_seed(1)))
    items = _build_items(iter(sources), pair.serialize, 1, sources=[])[0]
    layout = SenderLayout.build(items, bucket_bytes=9000, version=1, sources=sources)
    plan: FillPlan = layout.fill
    hits = [torch.zeros(n, dtype=torch.int32) for n in plan.nbytes]
    for b, gaps in enumerate(plan.gaps):
        for lo, hi in gaps:
            hits[b][lo:hi] += 1
    for pieces in plan.pieces:
        for piece in pieces:
            for b, offset, nbytes in piece.places:
                hits[b][offset : offset + piece.count * nbytes] += 1
    assert all(bool((h == 1).all()) for h in hits)
    counts = {
        piece.count for j, pieces in enumerate(plan.pieces) for piece in pieces if layout.item_specs(j)[0]
    }
    if fmt == "fp8_blockwise":  # 4-byte scales padded to 16: a stack is cut into one-member pieces
        assert counts == {1}
    else:  # bf16 experts lie back to back: runs of members per bucket
        assert max(counts) > 1


def test_changed_items_are_serialized_and_packed_in_full(gen):
    pair = Pair("fp8_blockwise", bucket_bytes=3000)
    items = trainer_items(pair.plan, gen)
    assert not pair.sync(items, 1)[1]
    # the same names as per-expert items instead of stacks: another source signature
    split = []
    for name, t in trainer_items(pair.plan, gen):
        split.extend([(name, t)] if isinstance(name, str) else zip(name, t.unbind(0)))
    stats, errors = pair.sync(split, 2)
    assert not errors and not stats.in_place
    assert pair.engine.snapshot() == (2, per_tensor_wire(pair.serialize, split))
    stats, errors = pair.sync([(n, t.clone()) for n, t in split], 3)  # now the cached layout is the split one
    assert not errors and stats.in_place and not stats.full_manifest
    assert pair.engine.snapshot()[0] == 3


@pytest.mark.parametrize("fmt", ["fp8_blockwise", "int4_qat", "bf16"])
def test_a_non_finite_expert_in_a_filled_sync_is_refused_by_name_with_nothing_committed(gen, fmt):
    pair = Pair(fmt, bucket_bytes=3000)
    assert not pair.sync(trainer_items(pair.plan, gen), 1)[1]
    held = pair.engine.snapshot()
    items = trainer_items(pair.plan, gen)
    k = next(i for i, (name, _) in enumerate(items) if not isinstance(name, str))
    names, stack = items[k]
    stack[3, 1, 2] = float("inf")
    with pytest.raises(SyncRefused, match=rf"refused before sending anything.*{names[3]}"):
        pair.sync(items, 2)
    assert pair.engine.snapshot() == held


def test_a_cast_that_overflows_in_a_filled_sync_is_refused_naming_the_wire_tensor(gen):
    """A serializer whose wire dtype is fp16: a finite bf16 input above 65504 becomes inf on the
    wire. No input is bad; the scan of the filled buckets flags it, the exact pass names the wire
    tensor, and not a byte leaves the sender."""

    def to_half(name, t):
        return {name: t.to(torch.float16)}

    weights = [(f"w{i}", torch.randn(5, 7, generator=gen).to(torch.bfloat16)) for i in range(4)]
    send_end, recv_end = in_process_pair(timeout_s=2.0)
    sender = WeightSender(send_end, serialize=to_half, bucket_bytes=100)
    receiver = WeightReceiver(
        recv_end, [ExpectedUnit(n, {n: ((5, 7), torch.float16)}) for n, _ in weights], verify_checksum=True
    )
    engine = DictEngine()
    thread = threading.Thread(target=lambda: receiver.receive(current_version=0, commit=engine.commit))
    thread.start()
    assert not sender.sync(weights, 1).in_place
    thread.join(timeout=10)
    loud = [(n, t.clone()) for n, t in weights]
    loud[2][1][4, 6] = 1.0e5
    with pytest.raises(SyncRefused, match="refused before sending anything") as refused:
        sender.sync(loud, 2)
    assert "w2" in str(refused.value) and "w1" not in str(refused.value)
    with pytest.raises(SyncTimeout):  # not a single frame (nor the manifest) left the sender
        recv_end.recv_frame(1 << 20, "anything")
    assert engine.version == 1


def test_copy_into_refuses_a_mismatched_place_and_copies_large_and_small(gen):
    big = torch.randn(1 << 19, generator=gen)  # 2 MiB: one by one
    small = torch.randint(0, 255, (13,), generator=gen, dtype=torch.uint8)
    dst_big, dst_small = torch.empty_like(big), torch.empty_like(small)
    copy_into([(dst_big, big), (dst_small, small)])
    assert torch.equal(dst_big, big) and torch.equal(dst_small, small)
    with pytest.raises(SyncError, match=r"float32\[4\].*float32\[5\]"):
        copy_into([(torch.empty(5), torch.empty(4))])


@pytest.mark.parametrize("fmt", ["fp8_blockwise", "mxfp8", "int4_qat"])
def test_the_grouped_write_into_the_buckets_gives_the_packed_bytes(gen, fmt, monkeypatch):
    """The path CUDA takes (`serialize_many_into` writing codes and scales straight into bucket
    views, one table row per piece), run on the CPU: the strategy is told its inputs are on a
    kernel device, and the grouped call's reference path writes into the given views."""
    from types import SimpleNamespace

    from skyq.quant.strategies import base

    monkeypatch.setattr(base, "dispatch", SimpleNamespace(uses_kernel=lambda t: True))
    pair = Pair(fmt, bucket_bytes=9000)
    sources, _ = _collect(trainer_items(pair.plan, gen))
    items = _build_items(iter(sources), pair.serialize, 1, sources=[])[0]
    layout = SenderLayout.build(items, bucket_bytes=9000, version=1, sources=sources)
    calls = []
    real = pair.serialize.strategy._quantize_group
    monkeypatch.setattr(
        pair.serialize.strategy,
        "_quantize_group",
        lambda *a, **k: calls.append(k.get("out")) or real(*a, **k),
    )
    filled = _fill(layout, sources, pair.serialize, 1)
    assert len(calls) == 1 and calls[0] is not None  # one grouped call, writing into the buckets
    assert len(calls[0]) > sum(1 for name, _ in sources if not isinstance(name, str))  # pieces, not stacks
    for b, (want, got) in enumerate(zip(layout.pack(items), filled)):
        assert torch.equal(want, got), f"bucket {b}"


def _plain_link(serialize, expected, bucket_bytes=512):
    send_end, recv_end = in_process_pair(timeout_s=10.0)
    sender = WeightSender(send_end, serialize=serialize, bucket_bytes=bucket_bytes)
    receiver = WeightReceiver(recv_end, expected, verify_checksum=True)
    engine = DictEngine()

    def sync(items, version):
        thread = threading.Thread(
            target=lambda: receiver.receive(current_version=engine.version, commit=engine.commit)
        )
        thread.start()
        try:
            return sender.sync(items, version)
        finally:
            thread.join(timeout=10)

    return sync, sender, engine


def test_a_stack_a_plain_serializer_takes_member_by_member_is_filled_in_place(gen):
    """A serializer without stack support turns a (names, stack) item into one unit per member; the
    fill maps that one source to its several wire items and copies each into place."""

    def serialize(name, t):
        return {name: t.to(torch.bfloat16), name + "_scale": t.float().abs().amax(dim=-1)}

    names = tuple(f"experts.{i}.w" for i in range(5))
    expected = [
        ExpectedUnit(n, {n: ((3, 8), torch.bfloat16), n + "_scale": ((3,), torch.float32)}) for n in names
    ]
    expected.append(ExpectedUnit("norm", {"norm": ((7,), torch.bfloat16), "norm_scale": ((), torch.float32)}))
    sync, sender, engine = _plain_link(serialize, expected)
    for version in (1, 2, 3):
        items = [(names, torch.randn(5, 3, 8, generator=gen)), ("norm", torch.randn(7, generator=gen))]
        stats = sync(items, version)
        assert stats.in_place == (version > 1)
        want = {}
        for n, t in [*zip(names, items[0][1].unbind(0)), items[1]]:
            want.update({k: raw(v) for k, v in serialize(n, t).items()})
        assert engine.snapshot() == (version, want)
    assert sender._layout.origins == (0, 5, 6)


def test_a_layout_with_a_bool_tensor_is_packed_not_filled(gen):
    """Bool tensors cannot be viewed in place in a bucket: such a layout has no fill plan and every
    sync is serialized and packed, with the same bytes delivered."""

    def serialize(name, t):
        return {name: t, name + "_mask": t > 0}

    expected = [ExpectedUnit("w", {"w": ((4, 4), torch.float32), "w_mask": ((4, 4), torch.bool)})]
    sync, sender, engine = _plain_link(serialize, expected)
    for version in (1, 2):
        w = torch.randn(4, 4, generator=gen)
        assert not sync([("w", w)], version).in_place
        assert engine.snapshot()[1]["w_mask"] == raw(w > 0)
    assert sender._layout.fill is None
