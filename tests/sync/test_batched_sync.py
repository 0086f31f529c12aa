"""Stacked weight items and bulk bucket packing change no byte: the same wire tensors, the same
manifest accounting, and wsum64 the same number as its defining formula."""

from __future__ import annotations

import threading

import pytest
import torch

from skyq.config.enums import Precision
from skyq.config.schema import PrecisionConfig
from skyq.quant.layouts import Role
from skyq.quant.strategies import get_strategy
from skyq.sync.buckets import WireUnit, pack_bucket, unpack_bucket
from skyq.sync.checksums import wsum64
from skyq.sync.errors import SyncError, SyncRefused
from skyq.sync.in_process import in_process_pair
from skyq.sync.receiver import ExpectedUnit, WeightReceiver
from skyq.sync.sender import WeightSender, build_units

from .wire_fixtures import DictEngine, raw_bytes


def wsum64_by_definition(buf: torch.Tensor) -> str:
    b = buf.to(torch.int64)
    w = torch.arange(buf.numel(), dtype=torch.int64) % 65521 + 1
    mask = (1 << 64) - 1
    return f"{buf.numel():x}-{int(b.sum()) & mask:016x}{int((b * w).sum()) & mask:016x}"


@pytest.mark.parametrize("n", [0, 1, 65520, 65521, 65522, 3 * 65521 + 17, 400_000])
def test_wsum64_is_its_definition_for_any_length_and_chunking(gen, n):
    buf = torch.randint(0, 256, (n,), generator=gen, dtype=torch.uint8)
    want = wsum64_by_definition(buf)
    assert wsum64(buf) == want
    assert wsum64(buf, chunk_bytes=1) == wsum64(buf, chunk_bytes=2 * 65521) == want


class Serializer:
    """A plan serializer for fp8 blockwise: every `*.weight` of the stack is a routed expert."""

    def __init__(self) -> None:
        self.strategy = get_strategy(PrecisionConfig(name=Precision.fp8_blockwise))

    def __call__(self, name, tensor):
        return self.strategy.serialize(name, tensor, role=Role.routed_expert)

    def serialize_stack(self, names, stack):
        return self.strategy.serialize_stack(names, stack, role=Role.routed_expert)


def sync(items, expected, version=1, bucket_bytes=80_000):
    send_end, recv_end = in_process_pair(timeout_s=5.0)
    engine, errors = DictEngine(), []

    def receive():
        try:
            WeightReceiver(recv_end, expected, verify_checksum=True).receive(
                current_version=0, commit=engine.commit
            )
        except Exception as exc:  # noqa: BLE001 - reported to the test
            errors.append(exc)

    thread = threading.Thread(target=receive)
    thread.start()
    try:
        stats = WeightSender(send_end, serialize=Serializer(), bucket_bytes=bucket_bytes).sync(items, version)
    finally:
        thread.join(timeout=10)
    assert not errors, errors
    return engine, stats


def test_a_stacked_item_commits_exactly_the_per_tensor_wire(gen):
    stack = (torch.randn(6, 128, 256, generator=gen) * 0.02).to(torch.bfloat16)
    norm = torch.randn(256, generator=gen).to(torch.bfloat16)
    names = [f"model.layers.0.mlp.experts.{i}.down_proj.weight" for i in range(6)]
    ser = Serializer()
    per_tensor = {n: ser(n, stack[i]) for i, n in enumerate(names)}
    per_tensor["model.norm.weight"] = ser("model.norm.weight", norm)
    expected = [
        ExpectedUnit(source=n, tensors={w: (tuple(t.shape), t.dtype) for w, t in wire.items()})
        for n, wire in per_tensor.items()
    ]
    stacked, stats = sync([(tuple(names), stack), ("model.norm.weight", norm)], expected)
    single, _ = sync([(n, stack[i]) for i, n in enumerate(names)] + [("model.norm.weight", norm)], expected)
    want = {w: raw_bytes(t) for wire in per_tensor.values() for w, t in wire.items()}
    assert stacked.snapshot() == single.snapshot() == (1, want)
    assert stats.num_tensors == 13 and stats.num_buckets > 1


def test_a_stack_with_a_non_finite_member_is_refused_naming_it(gen):
    stack = torch.randn(4, 128, 128, generator=gen).to(torch.bfloat16)
    stack[2, 5, 7] = float("nan")
    names = tuple(f"e.{i}.weight" for i in range(4))
    send_end, _ = in_process_pair(timeout_s=1.0)
    with pytest.raises(SyncRefused, match=r"e\.2\.weight"):
        WeightSender(send_end, serialize=Serializer(), bucket_bytes=1 << 20).sync([(names, stack)], 1)


def test_bulk_packing_coalesces_back_to_back_views_and_unpacks_every_tensor(gen):
    codes = torch.randint(0, 100, (8, 16, 32), generator=gen, dtype=torch.uint8).view(torch.float8_e4m3fn)
    scales = torch.rand(8, 2, 2, generator=gen)  # 16 bytes each: no padding, one run
    odd = torch.randn(3, generator=gen)  # 12 bytes: padded
    units = [
        WireUnit(source=f"u{i}", tensors={f"u{i}.w": codes[i], f"u{i}.s": scales[i]}) for i in range(8)
    ] + [
        WireUnit(source="odd", tensors={"odd": odd}),
        WireUnit(source="flag", tensors={"flag": torch.tensor([True, False])}),
    ]
    buf, entry = pack_bucket(0, units)
    assert len({t.name for t in entry.tensors}) == 18
    out = unpack_bucket(buf, entry, verify_checksum=True)
    for unit in units:
        for name, t in unit.tensors.items():
            assert out[name].dtype == t.dtype and out[name].shape == t.shape
            assert raw_bytes(out[name]) == raw_bytes(t), name
    ends = sorted((t.offset, t.offset + t.nbytes) for t in entry.tensors)
    assert all(b[0] >= a[1] and b[0] % 16 == 0 for a, b in zip(ends, ends[1:]))
    # every unit's codes first (back to back, one range), then the odd tensors, then the scales
    by_name = {t.name: t for t in entry.tensors}
    assert [by_name[f"u{i}.w"].offset for i in range(8)] == [512 * i for i in range(8)]
    assert by_name["u0.s"].offset > by_name["flag"].offset


class WholeSerializer(Serializer):
    """`Serializer` that also hands the sender whole wire tensors (what `PlanSerializer` does)."""

    def serialize_stack_tensors(self, names, stack):
        return self.strategy.serialize_stack_tensors(names, stack, role=Role.routed_expert)


@pytest.mark.parametrize("bucket_bytes", [1 << 20, 30_000])
def test_repeat_syncs_of_whole_stacks_with_padded_scales_commit_the_per_tensor_wire(gen, bucket_bytes):
    # 96 x 256 with 128 x 128 blocks: 8-byte scales, padded to 16, so a stack's scales lie strided
    # in the bucket (one strided copy on the sender, one strided view on the receiver); the small
    # bucket splits the stack across buckets.
    names = tuple(f"model.layers.0.mlp.experts.{i}.up_proj.weight" for i in range(5))
    ser = WholeSerializer()
    send_end, recv_end = in_process_pair(timeout_s=5.0)
    sender = WeightSender(send_end, serialize=ser, bucket_bytes=bucket_bytes)
    engine = DictEngine()
    expected = None
    for version in (1, 2, 3):
        stack = (torch.randn(5, 96, 256, generator=gen) * 0.02).to(torch.bfloat16)
        norm = torch.randn(7, generator=gen).to(torch.bfloat16)  # 14 bytes: padded too
        per_tensor = {n: ser(n, stack[i]) for i, n in enumerate(names)}
        per_tensor["model.norm.weight"] = ser("model.norm.weight", norm)
        if expected is None:
            expected = [
                ExpectedUnit(source=n, tensors={w: (tuple(t.shape), t.dtype) for w, t in wire.items()})
                for n, wire in per_tensor.items()
            ]
            receiver = WeightReceiver(recv_end, expected, verify_checksum=True)
        errors = []

        def receive(receiver=receiver, errors=errors):
            try:
                receiver.receive(current_version=engine.version, commit=engine.commit)
            except Exception as exc:  # noqa: BLE001 - reported to the test
                errors.append(exc)

        thread = threading.Thread(target=receive)
        thread.start()
        stats = sender.sync([(names, stack), ("model.norm.weight", norm)], version)
        thread.join(timeout=10)
        assert not errors, errors
        assert stats.full_manifest == (version == 1)
        want = {w: raw_bytes(t) for wire in per_tensor.values() for w, t in wire.items()}
        assert engine.snapshot() == (version, want)


def test_a_wire_name_produced_twice_is_refused_before_sending(gen):
    names = tuple(f"e.{i}.weight" for i in range(3))
    stack = torch.randn(3, 128, 128, generator=gen).to(torch.bfloat16)
    send_end, recv_end = in_process_pair(timeout_s=1.0)
    items = [(names, stack), ("e.1.weight", stack[1].clone())]
    with pytest.raises(SyncError, match=r"`e\.1\.weight` produced by both `e\.1\.weight` and `e\.1\.weight`"):
        WeightSender(send_end, serialize=WholeSerializer(), bucket_bytes=1 << 20).sync(items, 1)
    with pytest.raises(SyncError, match="produced by both"):
        build_units(items, WholeSerializer(), 1)
    with pytest.raises(SyncError):  # nothing reached the receiver's end
        recv_end.recv_frame(1 << 20, "a frame that must not exist")


def _plan_trainer(gen, precision: Precision):
    """A one-layer Qwen3-MoE-shaped plan and its trainer's items: dense tensors by name, each
    projection's experts as one (names, stack) item, as `WeightSender` gets them from a trainer."""
    from skyq.config.schema import ModelConfig
    from skyq.quant.plan import build_plan
    from skyq.sync.plan_wire import plan_serializer

    cfg = ModelConfig(
        name="tiny_moe_for_sync", hidden_size=256, num_layers=1, num_attention_heads=4, num_key_value_heads=2,
        head_dim=64, moe_intermediate_size=128, intermediate_size=512, num_experts=4, num_experts_per_tok=2,
        vocab_size=64,
    )  # fmt: skip
    precision_cfg = PrecisionConfig(name=precision)
    plan = build_plan(cfg, precision_cfg)
    strategy = get_strategy(precision_cfg)
    dense, stacks = [], {}
    for p in plan:
        t = (torch.randn(p.shape, generator=gen) * 0.05).to(torch.bfloat16)
        if ".mlp.experts." in p.name:
            prefix, rest = p.name.split(".mlp.experts.")
            stacks.setdefault((prefix, rest.split(".", 1)[1]), []).append((p.name, t))
        else:
            dense.append((p.name, t))
    items = dense + [(tuple(n for n, _ in m), torch.stack([t for _, t in m])) for m in stacks.values()]
    return plan, strategy, plan_serializer(strategy, plan), items


@pytest.mark.parametrize("batch_bytes", [None, 1])
@pytest.mark.parametrize("precision", [Precision.fp8_blockwise, Precision.mxfp8, Precision.int4_qat])
def test_a_plan_sender_batches_its_quantization_and_the_engine_gets_each_tensors_serialize(
    gen, precision, batch_bytes, monkeypatch
):
    """`PlanSerializer.serialize_many`: the items serialized in one call (fp8: one quantizer launch
    for all matrices and stacks on CUDA), or one call per item when `BATCH_BYTES` is that small, the
    same wire bytes as serializing each tensor."""
    from skyq.sync import sender
    from skyq.sync.plan_wire import expected_units

    if batch_bytes is not None:
        monkeypatch.setattr(sender, "BATCH_BYTES", batch_bytes)

    plan, strategy, serialize, items = _plan_trainer(gen, precision)
    send_end, recv_end = in_process_pair(timeout_s=10.0)
    engine = DictEngine()
    receiver = WeightReceiver(recv_end, expected_units(plan), verify_checksum=True)
    thread = threading.Thread(target=lambda: receiver.receive(current_version=0, commit=engine.commit))
    thread.start()
    WeightSender(send_end, serialize=serialize, bucket_bytes=1 << 16).sync(items, 1)
    thread.join(timeout=20)
    want = {}
    for name, t in items:
        members = [(name, t)] if isinstance(name, str) else list(zip(name, t.unbind(0)))
        for n, m in members:
            want.update(strategy.serialize(n, m.clone(), role=plan[n].role))
    assert engine.version == 1 and engine.snapshot() == (1, {n: raw_bytes(t) for n, t in want.items()})


def test_a_plan_sender_refuses_a_non_finite_stack_member_naming_it_and_sends_nothing(gen):
    plan, _, serialize, items = _plan_trainer(gen, Precision.fp8_blockwise)
    names, stack = next((n, t) for n, t in items if not isinstance(n, str) and "down_proj" in n[0])
    stack[2, 3, 5] = float("inf")
    send_end, recv_end = in_process_pair(timeout_s=0.3)
    with pytest.raises(SyncRefused, match=rf"{names[2].replace('.', '[.]')}: 0 NaN and 1 inf"):
        WeightSender(send_end, serialize=serialize, bucket_bytes=1 << 16).sync(items, 1)
    with pytest.raises(SyncError):  # nothing left the sender
        recv_end.recv_frame(1 << 20, "anything")
