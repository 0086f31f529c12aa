"""MoE experts as one tensor a projection (`WireExperts.stack`) and the grouped decode path: the
routing, the sorted rows and the recombination reproduce the per-expert loop bit for bit, and the
experts' buffers stay views of the stack through in-place weight loads. The grouped kernel itself
needs a GPU (tests/gpu/test_fp8_gemv.py); here its CPU form (each expert's rows through
`fp8_weight_only_linear`) and, for bit equality with the loop, the experts' own CPU math."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from skyq.config.enums import Precision
from skyq.config.schema import PrecisionConfig
from skyq.quant.errors import QuantizationError
from skyq.quant.fake_quant import activation_fake_quant
from skyq.quant.kernels import dispatch
from skyq.quant.layouts import Role
from skyq.quant.strategies import get_strategy
from skyq.rollout import quantized_linear
from skyq.rollout.kernels import fp8_linear, int4_mxfp8_linear
from skyq.rollout.quantized_linear import ExpertMLP, WireExperts, WireLinear

H, INTER, E = 256, 128, 6


def _linear(strategy, name: str, shape: tuple[int, int], gen: torch.Generator) -> WireLinear:
    layer = WireLinear(name, Role.routed_expert, strategy.wire_specs(name, shape, Role.routed_expert), strategy,
                       activation=None)  # fmt: skip
    w = torch.randn(shape, generator=gen) * 0.05
    for wire_name, t in strategy.serialize(name, w, role=Role.routed_expert).items():
        layer.get_buffer(wire_name.removeprefix(layer.stem)).copy_(t)
    return layer


def _experts(
    gen: torch.Generator, precision: Precision = Precision.fp8_blockwise, inter: int = INTER
) -> WireExperts:
    strategy = get_strategy(PrecisionConfig(name=precision))
    stem = "model.layers.0.mlp.experts"
    return WireExperts([
        ExpertMLP(*(_linear(strategy, f"{stem}.{e}.{p}.weight", shape, gen)
                    for p, shape in (("gate_proj", (inter, H)), ("up_proj", (inter, H)), ("down_proj", (H, inter)))),
                  act_fn=F.silu)
        for e in range(E)
    ])  # fmt: skip


def _routing(
    gen: torch.Generator, tokens: int, k: int = 3
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    hidden = torch.randn(tokens, H, generator=gen).to(torch.bfloat16)
    # experts 0..E-2 only (the last gets no token), k distinct a token
    index = torch.stack([torch.randperm(E - 1, generator=gen)[:k] for _ in range(tokens)])
    weights = torch.softmax(torch.randn(tokens, k, generator=gen), -1).to(torch.bfloat16)
    return hidden, index, weights


def _experts_own_math(experts: WireExperts, offsets_at: int):
    """A stand-in for a grouped launch (its arguments: x, the stacked weight, ..., the offsets at
    position `offsets_at`) with each expert's own CPU math on its rows (what the loop runs), so that
    the loop and the grouped path can be compared bit for bit."""

    def grouped(*args):
        x, w, offsets = args[0], args[1], args[offsets_at]
        proj = next(p for p, (q, _) in experts.stacked.items() if q is w)
        projs = ("gate_proj", "up_proj") if proj == "gate_up_proj" else (proj,)
        bounds = offsets.tolist()
        out = x.new_empty((x.shape[0], w.shape[1]))
        for e, (a, b) in enumerate(zip(bounds, bounds[1:])):
            if b > a:
                out[a:b] = torch.cat([getattr(experts[e], p)(x[a:b]) for p in projs], dim=-1)
        return out

    return grouped


def test_stack_makes_the_experts_buffers_views_of_one_tensor_a_projection():
    gen = torch.Generator().manual_seed(0)
    experts = _experts(gen)
    before = {n: t.clone() for n, t in experts.state_dict().items()}
    assert experts.stack()
    after = experts.state_dict()
    assert all(torch.equal(before[n], after[n]) for n in before)  # values kept
    q, s = experts.stacked["down_proj"]
    assert q.shape == (E, H, INTER) and q.dtype == torch.float8_e4m3fn and s.shape[0] == E
    for e in range(E):
        assert experts[e].down_proj.get_buffer("weight").data_ptr() == q[e].data_ptr()
    # an in-place load into an expert's buffer (as the engine's weight loads do) lands in the stack
    experts[2].up_proj.get_buffer("weight_scale_inv").fill_(0.5)
    assert bool((experts.stacked["up_proj"][1][2] == 0.5).all())
    assert all(experts._stack_is_live(p) for p in WireExperts.PROJECTIONS)
    experts[E - 1].gate_proj._buffers["weight"] = experts[E - 1].gate_proj._buffers["weight"].clone()
    assert not experts._stack_is_live("gate_proj")  # a replaced buffer: the grouped path is not taken


def test_gate_and_up_share_one_stack_when_their_rows_fill_whole_scale_blocks():
    """gate rows then up rows in one [E, 2I, H] stack (codes, and scale rows), each expert's gate and
    up buffers views of it; with I not a whole number of 128-row scale blocks, separate stacks."""
    gen = torch.Generator().manual_seed(4)
    experts = _experts(gen)
    before = {n: t.clone() for n, t in experts.state_dict().items()}
    assert experts.stack()
    assert all(torch.equal(before[n], t) for n, t in experts.state_dict().items())
    q, s = experts.stacked["gate_up_proj"]
    assert q.shape == (E, 2 * INTER, H) and s.shape == (E, 2 * INTER // 128, H // 128)
    for e in range(E):
        assert experts[e].gate_proj.get_buffer("weight").data_ptr() == q[e].data_ptr()
        assert experts[e].up_proj.get_buffer("weight").data_ptr() == q[e, INTER].data_ptr()
        assert experts[e].up_proj.get_buffer("weight_scale_inv").data_ptr() == s[e, INTER // 128].data_ptr()
    experts[3].up_proj.get_buffer("weight").fill_(1.0)
    assert bool((q[3, INTER:].float() == 1.0).all()) and not bool((q[3, :INTER].float() == 1.0).all())
    odd = _experts(gen, inter=INTER + 64)
    assert odd.stack() and "gate_up_proj" not in odd.stacked
    assert odd.stacked["gate_proj"][0].shape == (E, INTER + 64, H)


def test_a_move_stacks_the_experts_again():
    """`.to()` and friends give every buffer a new tensor; the stacks are rebuilt from them."""
    gen = torch.Generator().manual_seed(2)
    experts = _experts(gen)
    assert experts.stack()
    old = experts.stacked["down_proj"][0]
    experts._apply(lambda t: t.clone())  # what a device move does to each buffer
    q = experts.stacked["down_proj"][0]
    assert q.data_ptr() != old.data_ptr() and torch.equal(q.float(), old.float())
    assert all(experts._stack_is_live(p) for p in WireExperts.PROJECTIONS)


def test_stack_refuses_experts_it_cannot_group():
    gen = torch.Generator().manual_seed(1)
    mixed = _experts(gen, Precision.mxfp8)
    mixed[2].down_proj = _experts(gen)[2].down_proj  # one FP8 blockwise projection among MXFP8 ones
    assert not mixed.stack() and mixed.kind is None
    assert not WireExperts([]).stack()
    experts = _experts(gen)
    experts[1].down_proj._buffers["weight"] = torch.zeros(H, INTER + 128, dtype=torch.float8_e4m3fn)
    assert not experts.stack() and experts.stacked == {}


@pytest.mark.parametrize("tokens", [1, 5, 16])
def test_grouped_forward_is_the_loop_bit_for_bit(tokens, monkeypatch):
    gen = torch.Generator().manual_seed(tokens)
    experts = _experts(gen)
    assert experts.stack()
    hidden, index, weights = _routing(gen, tokens)
    loop = experts(hidden, index, weights)  # on CPU the grouped path does not apply
    monkeypatch.setattr(
        quantized_linear.fp8_linear, "fp8_grouped_weight_only_linear", _experts_own_math(experts, 3)
    )
    grouped = experts._grouped_forward(hidden, index, weights)
    assert grouped.dtype == loop.dtype and torch.equal(grouped, loop)


def test_grouped_forward_with_the_cpu_grouped_linear_matches_the_loop():
    """The real CPU form of the grouped linear (fp32 products of the same bf16 weight) against the
    loop's bf16 F.linear: equal up to the last bits of bf16."""
    gen = torch.Generator().manual_seed(7)
    experts = _experts(gen)
    assert experts.stack()
    hidden, index, weights = _routing(gen, 9)
    loop = experts(hidden, index, weights).float()
    grouped = experts._grouped_forward(hidden, index, weights).float()
    assert float((grouped - loop).norm() / loop.norm()) < 1e-2


def test_fp8_prefill_dequantizes_each_stack_once_into_one_grouped_gemm(monkeypatch):
    """More tokens than a decode (prefill): each FP8 stack is dequantized in one call (the bf16 weight
    the loop's experts use) and multiplied by `torch._grouped_mm` (CPU here), not by the weight-only
    kernel; the result is the loop's within bf16 rounding."""
    gen = torch.Generator().manual_seed(5)
    experts = _experts(gen)
    assert experts.stack()
    hidden, index, weights = _routing(gen, quantized_linear.DECODE_MAX_ROWS + 6)
    loop = experts(hidden, index, weights).float()
    dequantized = []
    real = dispatch.dequantize_fp8_blockwise
    monkeypatch.setattr(quantized_linear.dispatch, "dequantize_fp8_blockwise",
                        lambda q, *a, **k: dequantized.append((q, k["name"])) or real(q, *a, **k))  # fmt: skip

    def no_decode_kernel(*args):
        raise AssertionError("the weight-only decode kernel ran on a prefill")

    monkeypatch.setattr(quantized_linear.fp8_linear, "fp8_grouped_weight_only_linear", no_decode_kernel)
    grouped = experts._grouped_forward(hidden, index, weights).float()
    assert len(dequantized) == 3  # prefill: gate and up each their own GEMM, as the trainer's
    assert all(
        torch.equal(q.view(torch.uint8), experts.stacked[p][0].view(torch.uint8))
        for (q, _), p in zip(dequantized, WireExperts.PROJECTIONS, strict=True)
    )
    assert [name for _, name in dequantized] == [
        f"model.layers.0.mlp.experts.*.{p}.weight" for p in WireExperts.PROJECTIONS
    ]
    assert float((grouped - loop).norm() / loop.norm()) < 1e-2


def test_grouped_linear_cpu_form_and_its_errors():
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(3, 256, 384, generator=gen)
    q, s = dispatch.quantize_fp8_blockwise(w)
    x = torch.randn(7, 384, generator=gen).to(torch.bfloat16)
    offsets = torch.tensor([0, 2, 2, 7], dtype=torch.int32)
    y = fp8_linear.fp8_grouped_weight_only_linear(x, q, s, offsets)
    assert torch.equal(y[0:2], fp8_linear.fp8_weight_only_linear(x[0:2], q[0], s[0]))
    assert torch.equal(y[2:7], fp8_linear.fp8_weight_only_linear(x[2:7], q[2], s[2]))
    with pytest.raises(QuantizationError, match="offsets must be int32"):
        fp8_linear.fp8_grouped_weight_only_linear(x, q, s, offsets.long())
    with pytest.raises(QuantizationError, match="must rise from 0 to the 7 routed rows"):
        fp8_linear.fp8_grouped_weight_only_linear(x, q, s, torch.tensor([0, 3, 2, 7], dtype=torch.int32))
    with pytest.raises(QuantizationError, match="weight must be"):
        fp8_linear.fp8_grouped_weight_only_linear(x, q[0], s[0], offsets)


def _bf16_experts(gen: torch.Generator) -> WireExperts:
    def linear(shape):
        lin = torch.nn.Linear(shape[1], shape[0], bias=False, dtype=torch.bfloat16).requires_grad_(False)
        lin.weight.copy_(torch.randn(shape, generator=gen) * 0.05)
        return lin

    return WireExperts([
        ExpertMLP(linear((INTER, H)), linear((INTER, H)), linear((H, INTER)), act_fn=F.silu) for _ in range(E)
    ])  # fmt: skip


def test_bf16_experts_stack_their_weights_and_the_grouped_forward_is_the_loop(monkeypatch):
    """bf16 experts (the engine's bf16 precision) stack their weight parameters; with each expert's
    own math standing in for torch._grouped_mm the grouped forward equals the loop bit for bit,
    and with torch._grouped_mm itself (CPU here) within bf16 rounding."""
    gen = torch.Generator().manual_seed(11)
    experts = _bf16_experts(gen)
    before = {n: t.clone() for n, t in experts.state_dict().items()}
    assert experts.stack()
    w, scale = experts.stacked["up_proj"]
    assert scale is None and w.shape == (E, INTER, H)
    assert all(torch.equal(before[n], t) for n, t in experts.state_dict().items())
    assert experts[3].up_proj.weight.data_ptr() == w[3].data_ptr()
    assert not experts[3].up_proj.weight.requires_grad
    experts.state_dict()["3.down_proj.weight"].fill_(0.25)  # an in-place load, as the engine's
    assert bool((experts.stacked["down_proj"][0][3] == 0.25).all())
    hidden, index, weights = _routing(gen, 7)
    loop = experts(hidden, index, weights)

    with monkeypatch.context() as m:
        m.setattr(quantized_linear, "bf16_grouped_linear", _experts_own_math(experts, 2))
        assert torch.equal(experts._grouped_forward(hidden, index, weights), loop)
    grouped = experts._grouped_forward(hidden, index, weights).float()
    assert float((grouped - loop.float()).norm() / loop.float().norm()) < 1e-2


def _spy(monkeypatch, name: str, calls: list, module=quantized_linear.dispatch):
    real = getattr(module, name)

    def spy(*args, **kwargs):
        calls.append(args[1])
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, spy)


def test_a_large_decode_step_takes_the_grouped_kernel_on_the_stacks(monkeypatch):
    """In a decode step (`decode_step`) of more tokens than `DECODE_MAX_ROWS`, FP8 experts holding at
    most `GROUPED_DECODE_MAX_MEAN_ROWS` rows each on average go through the grouped weight-only kernel
    (CPU form here) on the stacks themselves: one call for gate+up, one for down, no dequantized
    weight; the result is the loop's within bf16 rounding. Outside a step the same forward is a
    prefill (three dequantized stacks)."""
    gen = torch.Generator().manual_seed(21)
    experts = _experts(gen)
    assert experts.stack()
    tokens = quantized_linear.DECODE_MAX_ROWS + 8
    assert tokens * 3 <= quantized_linear.GROUPED_DECODE_MAX_MEAN_ROWS * E
    hidden, index, weights = _routing(gen, tokens)
    loop = experts(hidden, index, weights).float()
    kernel, dequantized = [], []
    _spy(monkeypatch, "fp8_grouped_weight_only_linear", kernel, module=quantized_linear.fp8_linear)
    _spy(monkeypatch, "dequantize_fp8_blockwise", dequantized, module=quantized_linear.dispatch)
    with quantized_linear.decode_step():
        assert quantized_linear.in_decode_step()
        step = experts._grouped_forward(hidden, index, weights).float()
    assert not quantized_linear.in_decode_step()
    assert [q is experts.stacked[p][0] for q, p in zip(kernel, ("gate_up_proj", "down_proj"), strict=True)] == [
        True, True
    ]  # fmt: skip
    assert dequantized == []
    assert float((step - loop).norm() / loop.norm()) < 1e-2
    kernel.clear()
    experts._grouped_forward(hidden, index, weights)
    assert kernel == [] and len(dequantized) == 3


def test_a_decode_step_above_the_kernels_rows_dequantizes_each_stack_once(monkeypatch):
    """A decode step whose experts average more than `GROUPED_DECODE_MAX_MEAN_ROWS` rows: each stack
    (the gate+up one as it is, no copy of its halves) dequantized once into one grouped GEMM."""
    gen = torch.Generator().manual_seed(22)
    experts = _experts(gen)
    assert experts.stack()
    monkeypatch.setattr(quantized_linear, "GROUPED_DECODE_MAX_MEAN_ROWS", 4)
    hidden, index, weights = _routing(gen, quantized_linear.DECODE_MAX_ROWS + 1)
    loop = experts(hidden, index, weights).float()
    kernel, dequantized = [], []
    _spy(monkeypatch, "fp8_grouped_weight_only_linear", kernel, module=quantized_linear.fp8_linear)
    real = dispatch.dequantize_fp8_blockwise
    monkeypatch.setattr(quantized_linear.dispatch, "dequantize_fp8_blockwise",
                        lambda q, *a, **k: dequantized.append(q) or real(q, *a, **k))  # fmt: skip
    with quantized_linear.decode_step():
        step = experts._grouped_forward(hidden, index, weights).float()
    assert kernel == []
    assert [q is experts.stacked[p][0] for q, p in zip(dequantized, ("gate_up_proj", "down_proj"), strict=True)] == [
        True, True
    ]  # fmt: skip
    assert float((step - loop).norm() / loop.norm()) < 1e-2


def test_a_large_bf16_decode_step_multiplies_the_stacks_without_copying_them(monkeypatch):
    """bf16 experts in a decode step of more than `DECODE_MAX_ROWS` tokens: two grouped GEMMs on the
    stacks as they are (the gate+up stack not copied apart, as a prefill does to keep the trainer's
    bits: three GEMMs on contiguous copies)."""
    gen = torch.Generator().manual_seed(23)
    experts = _bf16_experts(gen)
    assert experts.stack() and "gate_up_proj" in experts.stacked
    hidden, index, weights = _routing(gen, quantized_linear.DECODE_MAX_ROWS + 5)
    calls = []
    _spy(monkeypatch, "bf16_grouped_linear", calls, module=quantized_linear)
    with quantized_linear.decode_step():
        step = experts._grouped_forward(hidden, index, weights)
    assert [w is experts.stacked[p][0] for w, p in zip(calls, ("gate_up_proj", "down_proj"), strict=True)] == [
        True, True
    ]  # fmt: skip
    calls.clear()
    prefill = experts._grouped_forward(hidden, index, weights)
    assert len(calls) == 3 and all(w.is_contiguous() for w in calls)
    assert calls[0].data_ptr() != experts.stacked["gate_up_proj"][0].data_ptr()  # a copy of the gate half
    assert float((step.float() - prefill.float()).norm() / prefill.float().norm()) < 1e-2


def test_int4_experts_stack_their_packed_codes_and_scales():
    """Symmetric INT4 experts stack `weight_packed` and `weight_scale` per projection, gate and up
    as one [E, 2I, ...] stack (rows of gate then up, each row its own group scales) whose halves are
    the gate and up stacks; each expert's buffers views of the stacks and in-place loads landing in
    them; `weight_shape` stays each expert's own."""
    gen = torch.Generator().manual_seed(21)
    experts = _experts(gen, Precision.int4_qat)
    before = {n: t.clone() for n, t in experts.state_dict().items()}
    assert experts.stack() and experts.kind == "int4"
    assert all(torch.equal(before[n], t) for n, t in experts.state_dict().items())
    assert set(experts.stacked) == {"gate_up_proj", *WireExperts.PROJECTIONS}
    group = experts[0].up_proj.strategy.group_size
    fused_q, fused_s = experts.stacked["gate_up_proj"]
    assert fused_q.shape == (E, 2 * INTER, H // 8) and fused_s.shape == (E, 2 * INTER, H // group)
    packed, scale = experts.stacked["up_proj"]
    assert packed.shape == (E, INTER, H // 8) and packed.dtype == torch.int32
    assert scale.shape == (E, INTER, H // group)
    for e in range(E):
        assert experts[e].up_proj.get_buffer("weight_packed").data_ptr() == packed[e].data_ptr()
        assert experts[e].up_proj.get_buffer("weight_scale").data_ptr() == scale[e].data_ptr()
        assert torch.equal(fused_q[e, INTER:], before[f"{e}.up_proj.weight_packed"])
        assert torch.equal(fused_s[e, :INTER], before[f"{e}.gate_proj.weight_scale"])
    assert (
        experts[1].up_proj.get_buffer("weight_shape").data_ptr()
        != experts[2].up_proj.get_buffer("weight_shape").data_ptr()
    )
    experts[4].down_proj.get_buffer("weight_scale").fill_(0.5)
    assert bool((experts.stacked["down_proj"][1][4] == 0.5).all())
    assert all(experts._stack_is_live(p) for p in WireExperts.PROJECTIONS)
    experts[0].gate_proj._buffers["weight_packed"] = experts[0].gate_proj._buffers["weight_packed"].clone()
    assert not experts._stack_is_live("gate_proj")


def _per_expert_linear(x, w, offsets):
    """`bf16_grouped_linear` as each expert's own `F.linear` on its rows."""
    bounds = offsets.tolist()
    out = x.new_zeros((x.shape[0], w.shape[1]))
    for e, (a, b) in enumerate(zip(bounds, bounds[1:], strict=False)):
        if b > a:
            out[a:b] = F.linear(x[a:b], w[e])
    return out


@pytest.mark.parametrize("precision", [Precision.int4_qat, Precision.mxfp8])
@pytest.mark.parametrize("tokens", [5, quantized_linear.DECODE_MAX_ROWS + 5])
def test_dequantized_stacks_grouped_forward_is_the_loop(monkeypatch, precision, tokens):
    """The INT4 / MXFP8 grouped path (outside decode steps): MXFP8's activation quantizer on the
    sorted rows, each stack dequantized in one call, one grouped GEMM a projection. With each
    expert's own CPU GEMM on its rows of the dequantized stack standing in for `torch._grouped_mm`,
    the result equals the per-expert loop bit for bit (so the stack's dequantization and the rows'
    quantization are each expert's, bit for bit); with `torch._grouped_mm` itself (CPU here), within
    bf16 rounding."""
    gen = torch.Generator().manual_seed(22)
    experts = _experts(gen, precision)
    activation = activation_fake_quant(PrecisionConfig(name=precision))  # the engine's (None for INT4)
    for expert in experts:
        for p in WireExperts.PROJECTIONS:
            getattr(expert, p).activation = activation
    assert experts.stack() and experts.kind == precision.value.split("_")[0]
    hidden, index, weights = _routing(gen, tokens)
    loop = experts(hidden, index, weights)  # on CPU the grouped path does not apply

    with monkeypatch.context() as m:
        m.setattr(quantized_linear, "bf16_grouped_linear", _per_expert_linear)
        assert torch.equal(experts._grouped_forward(hidden, index, weights), loop)
    grouped = experts._grouped_forward(hidden, index, weights).float()
    assert float((grouped - loop.float()).norm() / loop.float().norm()) < 1e-2


def test_an_asymmetric_int4_linear_is_not_stacked():
    gen = torch.Generator().manual_seed(23)
    asymmetric = _experts(gen, Precision.int4_qat)
    asymmetric[0].gate_proj.register_buffer(
        "weight_zero_point", torch.zeros(INTER // 8, H // 32, dtype=torch.int32)
    )
    assert not asymmetric.stack() and asymmetric.kind is None


def test_int4_experts_in_a_decode_step_take_the_grouped_int4_linear_on_the_stacks(monkeypatch):
    """In a decode step INT4 experts run `int4_mxfp8_linear.int4_grouped_weight_only_linear` on the stacks
    themselves (gate and up as one stack, then down: the INT4 kernel on a GPU, its reference here),
    no weight dequantized; the result is the loop's within bf16 rounding. Outside a step the same
    forward dequantizes gate, up and down apart (prefill: the trainer's bits, bit for bit the
    loop's here). On CPU tensors the engine never picks it (`_int4_decodes`: the kernel needs
    CUDA)."""
    gen = torch.Generator().manual_seed(24)
    experts = _experts(gen, Precision.int4_qat)
    assert experts.stack() and experts.kind == "int4"
    hidden, index, weights = _routing(gen, 9)
    loop = experts(hidden, index, weights).float()
    kernel, dequantized = [], []
    _spy(monkeypatch, "int4_grouped_weight_only_linear", kernel, module=quantized_linear.int4_mxfp8_linear)
    _spy(monkeypatch, "dequantize_int4_packed", dequantized)
    with quantized_linear.decode_step():
        assert not experts._kernel_decodes(hidden)
        step = experts._grouped_forward(hidden, index, weights).float()
    assert [
        q is experts.stacked[p][0] for q, p in zip(kernel, ("gate_up_proj", "down_proj"), strict=True)
    ] == [True] * 2
    assert dequantized == []
    assert float((step - loop).norm() / loop.norm()) < 1e-2
    kernel.clear()
    with monkeypatch.context() as m:  # each expert's own GEMM standing in for torch._grouped_mm
        m.setattr(quantized_linear, "bf16_grouped_linear", _per_expert_linear)
        assert torch.equal(experts._grouped_forward(hidden, index, weights).float(), loop)
    assert kernel == [] and len(dequantized) == 3


def test_an_int4_linear_decodes_through_the_int4_linear_in_decode_steps_only(monkeypatch):
    """A symmetric INT4 `WireLinear` whose input the kernel takes (forced here: the kernel needs CUDA)
    calls `int4_mxfp8_linear.int4_weight_only_linear` on its own words and scales in a decode step (the
    reference standing in for the GPU kernel), and dequantizes its weight outside one; the two agree
    within bf16 rounding. An asymmetric one (zero points) never takes it."""
    gen = torch.Generator().manual_seed(25)
    strategy = get_strategy(PrecisionConfig(name=Precision.int4_qat))
    linear = _linear(strategy, "model.layers.0.self_attn.q_proj.weight", (INTER, H), gen)
    x = torch.randn(4, H, generator=gen).to(torch.bfloat16)
    calls = []
    monkeypatch.setattr(int4_mxfp8_linear, "int4_kernel_takes", lambda *a: True)
    monkeypatch.setattr(int4_mxfp8_linear, "int4_weight_only_linear",
                        lambda x, p, s, g: calls.append((p, s, g)) or int4_mxfp8_linear.int4_weight_only_linear_reference(x, p, s, g))  # fmt: skip
    prefill = linear(x).float()
    assert calls == []
    with quantized_linear.decode_step():
        step = linear(x).float()
    ((packed, scale, group),) = calls
    assert packed is linear.get_buffer("weight_packed") and scale is linear.get_buffer("weight_scale")
    assert group == strategy.group_size
    assert float((step - prefill).norm() / prefill.norm()) < 1e-2
    linear.register_buffer("weight_zero_point", torch.zeros(INTER // 8, H // group, dtype=torch.int32))
    assert not quantized_linear.int4_decodes(linear, x)


def _mxfp8_experts(gen: torch.Generator) -> tuple[WireExperts, object]:
    """MXFP8 experts with the engine's activation quantizer (1 x 32), stacked."""
    experts = _experts(gen, Precision.mxfp8)
    activation = activation_fake_quant(PrecisionConfig(name=Precision.mxfp8))
    for expert in experts:
        for p in WireExperts.PROJECTIONS:
            getattr(expert, p).activation = activation
    assert experts.stack() and experts.kind == "mxfp8"
    return experts, activation


def test_mxfp8_experts_stack_gate_and_up_as_one():
    """MXFP8 experts stack e4m3 codes and E8M0 scales per projection, gate and up as one [E, 2I, ...]
    stack whose halves are the gate and up stacks (each row its own scales)."""
    gen = torch.Generator().manual_seed(26)
    experts, _ = _mxfp8_experts(gen)
    q, s = experts.stacked["gate_up_proj"]
    assert q.shape == (E, 2 * INTER, H) and q.dtype == torch.float8_e4m3fn
    assert s.shape == (E, 2 * INTER, H // 32) and s.dtype == torch.uint8
    for e in range(E):
        assert experts[e].up_proj.get_buffer("weight").data_ptr() == q[e, INTER].data_ptr()
        assert experts[e].up_proj.get_buffer("weight_scale").data_ptr() == s[e, INTER].data_ptr()
    assert all(experts._stack_is_live(p) for p in WireExperts.PROJECTIONS)


def test_mxfp8_experts_in_a_decode_step_take_the_grouped_mxfp8_linear_on_the_stacks(monkeypatch):
    """In a decode step MXFP8 experts run `int4_mxfp8_linear.mxfp8_grouped_weight_only_linear` on the stacks
    themselves (gate and up as one stack, then down: the Gluon kernel on a GPU, its reference here)
    on their rows' activation-quantized values, no weight dequantized; the result is the loop's
    within bf16 rounding. Outside a step the same forward dequantizes gate, up and down apart and,
    with each expert's own GEMM standing in for `torch._grouped_mm`, equals the loop bit for bit."""
    gen = torch.Generator().manual_seed(27)
    experts, activation = _mxfp8_experts(gen)
    hidden, index, weights = _routing(gen, 9)
    loop = experts(hidden, index, weights).float()
    calls, dequantized = [], []
    real = int4_mxfp8_linear.mxfp8_grouped_weight_only_linear
    monkeypatch.setattr(quantized_linear.int4_mxfp8_linear, "mxfp8_grouped_weight_only_linear",
                        lambda x, q, s, offsets: calls.append((x, q)) or real(x, q, s, offsets))  # fmt: skip
    _spy(monkeypatch, "dequantize_mxfp8", dequantized)
    with quantized_linear.decode_step():
        assert not experts._kernel_decodes(hidden)  # the kernel needs CUDA
        step = experts._grouped_forward(hidden, index, weights).float()
    assert [
        q is experts.stacked[p][0] for (_, q), p in zip(calls, ("gate_up_proj", "down_proj"), strict=True)
    ] == [True] * 2
    assert all(torch.equal(activation(x), x) for x, _ in calls)  # the rows arrive quantized
    assert dequantized == []
    assert float((step - loop).norm() / loop.norm()) < 1e-2
    calls.clear()
    with monkeypatch.context() as m:
        m.setattr(quantized_linear, "bf16_grouped_linear", _per_expert_linear)
        assert torch.equal(experts._grouped_forward(hidden, index, weights).float(), loop)
    assert calls == [] and len(dequantized) == 3


def test_an_mxfp8_linear_decodes_through_the_mxfp8_linear_in_decode_steps_only(monkeypatch):
    """An MXFP8 `WireLinear` whose input the kernel takes (forced here: the kernel needs CUDA) calls
    `int4_mxfp8_linear.mxfp8_weight_only_linear` on its own codes and scales, after its activation
    quantizer, in a decode step (the reference standing in for the GPU kernel), and dequantizes its
    weight outside one; the two agree within bf16 rounding."""
    gen = torch.Generator().manual_seed(28)
    strategy = get_strategy(PrecisionConfig(name=Precision.mxfp8))
    linear = _linear(strategy, "model.layers.0.self_attn.q_proj.weight", (INTER, H), gen)
    linear.activation = activation_fake_quant(PrecisionConfig(name=Precision.mxfp8))
    x = torch.randn(4, H, generator=gen).to(torch.bfloat16)
    calls = []
    monkeypatch.setattr(int4_mxfp8_linear, "mxfp8_kernel_takes", lambda *a: True)
    monkeypatch.setattr(int4_mxfp8_linear, "mxfp8_weight_only_linear",
                        lambda x, q, s: calls.append((x, q, s)) or int4_mxfp8_linear.mxfp8_weight_only_linear_reference(x, q, s))  # fmt: skip
    prefill = linear(x).float()
    assert calls == []
    with quantized_linear.decode_step():
        step = linear(x).float()
    ((xq, q, s),) = calls
    assert q is linear.get_buffer("weight") and s is linear.get_buffer("weight_scale")
    assert torch.equal(xq, linear.activation(x))
    assert float((step - prefill).norm() / prefill.norm()) < 1e-2
