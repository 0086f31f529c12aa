"""The embedded engine verifies and installs a sync where it holds its weights.

trainer=megatron with rollout=embedded on one GPU runs the trainer and the engine as two Ray actors,
and NCCL refuses two ranks on one device, so the buckets cross in host memory (gloo): the engine's
receiver got CPU frames. Its value check then dequantized every weight on the host and its commit
copied them to the GPU one tensor at a time (8-10 s a sync for small_moe at fp8_blockwise on an
H200, against ~0.05 s for trainer=torch, whose in-process frames are already on the GPU). Now the
frames go to the engine's device first, one copy per bucket (`WireState.to`; the receiver's `device`
does it before the checksums). Here: the engine loads the Megatron worker's items (`stacked_items`:
one stack per expert projection) with one dequantization per stack group, where the weights live,
and one word copy per run; on a GPU the same from host frames.
"""

from __future__ import annotations

import threading

import pytest
import torch

from skyq.quant.layouts import get_layout
from skyq.quant.plan import build_plan
from skyq.rollout.embedded import EmbeddedEngine
from skyq.sync import wire_state
from skyq.sync.in_process import in_process_pair
from skyq.sync.plan_wire import expected_units, plan_serializer, wire_digest
from skyq.sync.receiver import WeightReceiver
from skyq.sync.sender import WeightSender
from skyq.sync.wire_state import WireState
from skyq.trainer.megatron.worker import stacked_items


def export_pairs(cfg, seed: int) -> list[tuple[str, torch.Tensor]]:
    """(HF name, bf16 tensor) of every parameter of the plan, as the Megatron export yields them."""
    g = torch.Generator().manual_seed(seed)
    return [
        (p.name, (torch.randn(p.shape, generator=g) * 0.02).to(torch.bfloat16))
        for p in build_plan(cfg.model, cfg.precision)
    ]


class LoadSpy:
    """Counts what the engine's load does: the strategy's dequantizations (with the device of their
    inputs), the per-unit fallback, the typed copies, and the `WireState` the commit received."""

    def __init__(self, engine: EmbeddedEngine, monkeypatch) -> None:
        self.deserialized: list[tuple[str, torch.device]] = []
        self.per_unit = 0
        self.typed: list[str] = []
        self.committed: list[WireState] = []
        deserialize, check_each = engine.strategy.deserialize, engine._check_values_each
        copy_typed, load = wire_state.copy_typed, engine.load_weights

        def spy_deserialize(name, unit, **kwargs):
            self.deserialized.append((name, next(iter(unit.values())).device))
            return deserialize(name, unit, **kwargs)

        def spy_check_each(wire):
            self.per_unit += 1
            return check_each(wire)

        def spy_copy_typed(dest, wire, names):
            self.typed.extend(names)
            return copy_typed(dest, wire, names)

        def spy_load(wire, version):
            self.committed.append(wire)
            return load(wire, version)

        monkeypatch.setattr(engine.strategy, "deserialize", spy_deserialize)
        monkeypatch.setattr(engine, "_check_values_each", spy_check_each)
        monkeypatch.setattr(wire_state, "copy_typed", spy_copy_typed)
        self.load = spy_load


def sync_megatron_items(cfg, engine: EmbeddedEngine, spy: LoadSpy, pairs, *, device=None) -> WeightReceiver:
    """The Megatron worker's send (`stacked_items` of its export, the plan serializer) into `engine`
    through the real receiver over the in-process channel; versions 1 and 2 (full manifest, then a
    same-layout sync)."""
    plan = build_plan(cfg.model, cfg.precision)
    items = list(stacked_items(pairs, cfg.model, get_layout(cfg.model.family)))
    assert any(not isinstance(name, str) for name, _ in items)  # the experts go as stacks
    send_end, recv_end = in_process_pair(timeout_s=30.0)
    receiver = WeightReceiver(recv_end, expected_units(plan), verify_checksum=True, device=device)
    sender = WeightSender(send_end, serialize=plan_serializer(engine.strategy, plan), bucket_bytes=1 << 20)
    errors: list[BaseException] = []

    def receive() -> None:
        try:
            receiver.receive(current_version=engine.weight_version, commit=spy.load)
        except BaseException as exc:  # noqa: BLE001  (reported on the test's thread)
            errors.append(exc)

    for version in (1, 2):
        thread = threading.Thread(target=receive)
        thread.start()
        sender.sync(iter(items), version)
        thread.join(timeout=60)
        assert not thread.is_alive() and not errors, errors
    return receiver


def check_loaded(cfg, engine: EmbeddedEngine, spy: LoadSpy, pairs) -> None:
    """Both syncs committed bit-exactly, each dequantizing every stack group once on the engine's
    device and copying every tensor as words (no per-unit fallback, no typed copy)."""
    serialize = plan_serializer(engine.strategy, build_plan(cfg.model, cfg.precision))
    want = wire_digest({n: t for name, w in pairs for n, t in serialize(name, w).items()})
    assert engine.weight_version == 2 and wire_digest(engine.wire_state()) == want
    groups = [group[0].name for group in engine._stack_groups]
    assert max(len(group) for group in engine._stack_groups) >= cfg.model.num_experts  # experts stacked
    assert [name for name, _ in spy.deserialized] == groups * 2
    held = engine.model.state_dict()
    assert {device for _, device in spy.deserialized} == {next(iter(held.values())).device}
    assert spy.per_unit == 0 and spy.typed == []


@pytest.mark.parametrize("precision", ["fp8_blockwise", "int4_qat"])
def test_engine_loads_the_megatron_export_with_one_dequantization_per_stack_group(
    run_cfg, monkeypatch, precision
):
    cfg = run_cfg(precision)
    engine = EmbeddedEngine(model_cfg=cfg.model, precision_cfg=cfg.precision, seed=0)
    spy = LoadSpy(engine, monkeypatch)
    pairs = export_pairs(cfg, seed=1)
    sync_megatron_items(cfg, engine, spy, pairs)
    check_loaded(cfg, engine, spy, pairs)


def test_a_wire_state_already_on_the_device_is_not_copied(run_cfg, monkeypatch):
    cfg = run_cfg("fp8_blockwise")
    engine = EmbeddedEngine(model_cfg=cfg.model, precision_cfg=cfg.precision, seed=0)
    spy = LoadSpy(engine, monkeypatch)
    sync_megatron_items(cfg, engine, spy, export_pairs(cfg, seed=2), device="cpu")
    for wire in spy.committed:
        assert wire.to("cpu") is wire and wire.to(torch.device("cpu")) is wire


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("receiver_device", [None, "cuda"])
def test_host_frames_are_checked_and_installed_on_the_engine_gpu(run_cfg, monkeypatch, receiver_device):
    """The colocated trainer=megatron case: the frames arrive in host memory (here: the items on the
    host through the in-process channel), the engine is on the GPU. Receiver without a device (the
    engine moves the state on commit) or with the engine's (moved before the checksums)."""
    cfg = run_cfg("fp8_blockwise")
    engine = EmbeddedEngine(
        model_cfg=cfg.model, precision_cfg=cfg.precision, seed=0, device="cuda", cuda_graphs=False
    )
    spy = LoadSpy(engine, monkeypatch)
    pairs = export_pairs(cfg, seed=3)
    sync_megatron_items(cfg, engine, spy, pairs, device=receiver_device)
    check_loaded(cfg, engine, spy, pairs)
    arrived = {wire.to("cpu") is wire for wire in spy.committed}  # on the host iff the receiver left them
    assert arrived == {receiver_device is None}
