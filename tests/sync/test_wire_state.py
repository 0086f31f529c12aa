"""The receiver's `WireState` and `WireCopier`: a commit copies each tensor's bytes as the widest
integer word its size and place allow (one multi-tensor copy per word), bit-identical to a typed
copy, with the destination views kept per layout; anything that cannot go as words goes typed."""

from __future__ import annotations

import pytest
import torch

from skyq.sync.buckets import WireStack, WireUnit
from skyq.sync.byte_runs import word_dtype
from skyq.sync.layout import ReceiverLayout, SenderLayout
from skyq.sync.values import find_spans, spans_look_valid
from skyq.sync.wire_state import WireCopier, WireState, copy_typed

from .wire_fixtures import random_weights, raw_bytes, serialize_all


def received(items, *, bucket_bytes: int = 1 << 20, version: int = 1) -> WireState:
    """What a receiver hands its commit for `items`: pack, then unpack with the receiver's layout."""
    layout = SenderLayout.build(items, bucket_bytes=bucket_bytes, version=version)
    frames = [buf.clone() for buf in layout.pack(items)]
    manifest = layout.manifest(version, ["wsum64:0"] * len(frames))
    wire = ReceiverLayout.of(manifest, layout.digest).unpack(frames)
    assert isinstance(wire, WireState) and wire.layout == layout.digest
    return wire


def units_of(gen) -> list[WireUnit]:
    """The fixtures' wire kinds plus odd sizes (3-byte, 6-byte, bool, empty) and a stack of e4m3
    experts with fp32 scales, as a sender holds them."""
    units = [WireUnit(source=n, tensors=w) for n, w in serialize_all(random_weights(gen)).items()]
    units.append(WireUnit(source="odd.a", tensors={"odd.a": torch.randint(0, 255, (3,), dtype=torch.uint8)}))
    units.append(WireUnit(source="odd.b", tensors={"odd.b": torch.randn(3, generator=gen).to(torch.float16)}))
    units.append(WireUnit(source="odd.mask", tensors={"odd.mask": torch.tensor([True, False, True])}))
    units.append(WireUnit(source="odd.empty", tensors={"odd.empty": torch.zeros(0, 4, dtype=torch.bfloat16)}))
    return units


def stack_of(gen, n: int = 5) -> WireStack:
    codes = (torch.randn(n, 4, 24, generator=gen) * 50).clamp(-448, 448).to(torch.float8_e4m3fn)
    scales = torch.rand(n, 1, 3, generator=gen)
    names = [f"experts.{e}.weight" for e in range(n)]
    return WireStack(
        sources=tuple(names),
        names=(tuple(names), tuple(f"experts.{e}.weight_scale_inv" for e in range(n))),
        tensors=(codes, scales),
    )


def engine_like(wire) -> dict[str, torch.Tensor]:
    return {
        n: torch.full_like(t, 0) if t.dtype != torch.bool else torch.zeros_like(t) for n, t in wire.items()
    }


def assert_same_bytes(dest, wire) -> None:
    assert set(dest) == set(wire)
    for name, t in wire.items():
        assert dest[name].dtype == t.dtype and dest[name].shape == t.shape, name
        assert raw_bytes(dest[name]) == raw_bytes(t), name


def test_word_dtype_is_the_widest_word_dividing_every_number():
    assert word_dtype(1536, 16, 4096) == torch.int32  # int64 at most 32-aligned in a bucket: never
    assert word_dtype(384, 12) == torch.int32
    assert word_dtype(6, 16) == torch.int16
    assert word_dtype(3, 16) == torch.uint8


def test_word_runs_view_the_same_bytes_as_the_typed_views(gen):
    items = [*units_of(gen), stack_of(gen)]
    wire = received(items)
    seen: set[str] = set()
    for run in wire.word_runs():
        for name, view in zip(run.names, run.views, strict=True):
            t = wire[name]
            assert view.dtype == run.word and view.ndim == 1, name
            assert view.data_ptr() == t.data_ptr(), name  # a view into the frame, not a copy
            assert raw_bytes(view) == raw_bytes(t), name
            seen.add(name)
    # everything but bool and empty tensors has a word view; the e4m3 stack goes as int32
    assert seen == {n for n, t in wire.items() if t.dtype != torch.bool and t.numel()}
    words = {name: run.word for run in wire.word_runs() for name in run.names}
    assert words["experts.3.weight"] == torch.int32 and words["odd.a"] == torch.uint8


def test_copier_installs_bit_identical_weights_and_keeps_its_plan_per_layout(gen):
    units = units_of(gen)
    dest = engine_like(received([*units, stack_of(gen)]))
    before = {n: t.data_ptr() for n, t in dest.items()}
    copier = WireCopier(dest)
    for i in range(3):  # new values, same layout: the plan is reused
        wire = received([*units_of(gen), stack_of(gen)])
        copier.copy(wire)
        if i:  # a kept plan copies words: typed views only for what has no word view
            made = {n for (b, r) in wire._views for n in wire._runs[b][r].names}
            assert made == set(copier._plan[1].typed) == {"odd.mask", "odd.empty"}
        assert_same_bytes(dest, wire)
        plan = copier._plan
    assert plan is copier._plan and {n: t.data_ptr() for n, t in dest.items()} == before
    # the typed path copied only what has no word view (bool, empty)
    assert set(plan[1].typed) == {"odd.mask", "odd.empty"}
    # a different layout (other bucket size) gets a new plan, still bit-identical
    wire = received([*units_of(gen), stack_of(gen)], bucket_bytes=256)
    copier.copy(wire)
    assert copier._plan is not plan
    assert_same_bytes(dest, wire)


def test_a_run_into_stacked_destinations_is_one_copy_with_no_member_views(gen):
    """An engine that holds the experts stacked ([E, ...] per wire position, as serving engines
    do): each run of the stack installs with one strided copy; a destination whose members are
    not at one pitch in one storage takes the per-member path, bit-identical either way."""
    n = 6
    wire = received([*units_of(gen), stack_of(gen, n)])
    dest = engine_like(wire)
    codes = torch.zeros(n, 4, 24, dtype=torch.float8_e4m3fn)
    scales = torch.zeros(n + 1, 1, 3)[1:]  # stacked, starting at an offset into its storage
    for e in range(n):
        dest[f"experts.{e}.weight"], dest[f"experts.{e}.weight_scale_inv"] = codes[e], scales[e]
    copier = WireCopier(dest)
    copier.copy(wire)
    assert_same_bytes(dest, wire)
    stacked = [w for w in copier._plan[1].stacked if w is not None]
    assert len(stacked) == 2 and {w.shape[0] for w in stacked} == {n}
    assert {w.untyped_storage().data_ptr() for w in stacked} == {
        codes.untyped_storage().data_ptr(),
        scales.untyped_storage().data_ptr(),
    }
    for _ in range(2):  # new values, same plan: no member view on the receiving side
        wire = received([*units_of(gen), stack_of(gen, n)])
        copier.copy(wire)
        made = {name for (b, r) in wire._views for name in wire._runs[b][r].names}
        assert not any(name.startswith("experts.") for name in made), made
        assert_same_bytes(dest, wire)
    # members out of order in the stack, or in separate storages: one copy each, same bytes
    shuffled = dict(dest)
    shuffled["experts.0.weight"], shuffled["experts.1.weight"] = codes[1], codes[0]
    copier = WireCopier(shuffled)
    copier.copy(wire)
    assert_same_bytes(shuffled, wire)
    assert sum(w is not None for w in copier._plan[1].stacked) == 1  # the scales only


def test_copier_takes_the_typed_path_for_destinations_it_cannot_view_as_words(gen):
    wire = received([*units_of(gen), stack_of(gen)])
    dest = engine_like(wire)
    strided = torch.zeros(24, 4, dtype=torch.float8_e4m3fn).t()  # [4, 24], not contiguous
    dest["experts.2.weight"] = strided
    WireCopier(dest).copy(wire)
    assert_same_bytes(dest, wire)
    assert raw_bytes(strided.contiguous()) == raw_bytes(wire["experts.2.weight"])


def test_copier_copies_a_plain_dict_per_dtype_and_refuses_other_names(gen):
    wire = received(units_of(gen))
    plain = {n: t.clone() for n, t in wire.items()}
    dest = engine_like(plain)
    copier = WireCopier(dest)
    copier.copy(plain)
    assert_same_bytes(dest, plain)
    with pytest.raises(KeyError, match="missing"):
        copier.copy({n: t for n, t in plain.items() if n != "odd.a"})
    with pytest.raises(KeyError, match="unknown"):
        copier.copy({**plain, "extra": torch.zeros(1)})
    with pytest.raises(KeyError, match="missing"):
        WireCopier({**dest, "extra": torch.zeros(1)}).copy(wire)


def test_copy_typed_converts_nothing_and_handles_mixed_dtypes(gen):
    wire = received(units_of(gen))
    dest = engine_like(wire)
    copy_typed(dest, wire, list(wire))
    assert_same_bytes(dest, wire)


@pytest.mark.parametrize(
    "code,bad", [(0x7F, True), (0xFF, True), (0x7E, False), (0xFE, False), (0x80, False)]
)
def test_the_batched_value_check_finds_e4m3_nan_codes(gen, code, bad):
    stack = stack_of(gen)
    layout = SenderLayout.build([stack], bucket_bytes=1 << 20, version=1)
    frames = layout.pack([stack])
    receiver = ReceiverLayout.of(layout.manifest(1, ["wsum64:0"] * len(frames)), layout.digest)
    assert spans_look_valid(frames, receiver.spans)
    codes_run = next(r for r in receiver.runs[0] if r.dtype == torch.float8_e4m3fn)
    assert find_spans([codes_run])
    frames[0][codes_run.offset + 37] = code
    assert spans_look_valid(frames, receiver.spans) is not bad


def test_a_wire_state_is_a_read_only_mapping_that_views_on_first_use(gen):
    units = units_of(gen)
    wire = received(units, bucket_bytes=64)
    want = {n: t for u in units for n, t in u.tensors.items()}
    assert len(wire) == len(want) and set(wire) == set(want) and "nope" not in wire
    assert not wire._views
    name = "model.layers.0.self_attn.q_proj.weight"
    assert raw_bytes(wire[name]) == raw_bytes(want[name]) and wire[name] is wire[name]
    assert wire.get("nope") is None
    with pytest.raises(KeyError):
        wire["nope"]
    with pytest.raises(TypeError):
        wire[name] = want[name]  # type: ignore[index]
    assert {n: raw_bytes(t) for n, t in dict(wire).items()} == {n: raw_bytes(t) for n, t in want.items()}
