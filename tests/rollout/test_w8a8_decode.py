"""The engine's large decode steps on FP8 codes both sides (`quantized_linear.W8A8_MIN_MEAN_ROWS`), on
the CPU: FP8 experts averaging at least that many rows each, and dense FP8 linears of more than
`DECODE_MAX_ROWS` rows, multiply their inputs' activation codes by the weight codes
(`fp8_linear.fp8_grouped_w8a8_linear` / `fp8_w8a8_linear`, here their CPU reference) instead of the
weight-only kernel or a dequantized weight. The GPU condition (a CUDA device with e4m3 tensor cores,
`fp8_linear.w8a8_kernel_available`) is forced here; tests/gpu/test_w8a8_gpu.py runs the kernel."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from skyq.config.enums import Precision, ScaleFormat
from skyq.config.schema import PrecisionConfig
from skyq.quant.fake_quant import Fp8ActivationQuant, activation_fake_quant
from skyq.quant.layouts import Role
from skyq.quant.strategies import get_strategy
from skyq.rollout import quantized_linear
from skyq.rollout.quantized_linear import ExpertMLP, SharedInput, WireExperts, WireLinear, w8a8_quantizer

H, INTER, E, TOP_K = 256, 128, 6, 3


def _cfg(pow2: bool = False) -> PrecisionConfig:
    return PrecisionConfig(
        name=Precision.fp8_blockwise, scale_format=ScaleFormat.ue8m0 if pow2 else ScaleFormat.fp32
    )


def _linear(cfg, name: str, shape, gen, role=Role.routed_expert, activation=True) -> WireLinear:
    strategy = get_strategy(cfg)
    lin = WireLinear(name, role, strategy.wire_specs(name, shape, role), strategy,
                     activation_fake_quant(cfg) if activation else None)  # fmt: skip
    for wire_name, t in strategy.serialize(name, torch.randn(shape, generator=gen) * 0.05, role=role).items():
        lin.get_buffer(wire_name.removeprefix(lin.stem)).copy_(t)
    return lin


def _experts(gen, cfg, activation=True) -> WireExperts:
    stem = "model.layers.0.mlp.experts"
    shapes = (("gate_proj", (INTER, H)), ("up_proj", (INTER, H)), ("down_proj", (H, INTER)))
    experts = WireExperts([
        ExpertMLP(*(_linear(cfg, f"{stem}.{e}.{p}.weight", shape, gen, activation=activation) for p, shape in shapes),
                  act_fn=F.silu)
        for e in range(E)
    ])  # fmt: skip
    assert experts.stack() and "gate_up_proj" in experts.stacked
    return experts


def _routing(gen, tokens: int):
    hidden = torch.randn(tokens, H, generator=gen).to(torch.bfloat16)
    index = torch.stack([torch.randperm(E - 1, generator=gen)[:TOP_K] for _ in range(tokens)])  # E-1: no rows
    weights = torch.softmax(torch.randn(tokens, TOP_K, generator=gen), -1).to(torch.bfloat16)
    return hidden, index, weights


@pytest.fixture
def gpu_condition(monkeypatch):
    """What a CUDA device with e4m3 tensor cores answers (the kernel itself: CPU reference)."""
    monkeypatch.setattr(quantized_linear.fp8_linear, "w8a8_kernel_available", lambda device: True)
    monkeypatch.setattr(
        quantized_linear, "_large_decode_step",
        lambda x: quantized_linear.in_decode_step() and quantized_linear._rows(x) > quantized_linear.DECODE_MAX_ROWS,
    )  # fmt: skip


def _record(monkeypatch, names: tuple[str, ...]) -> dict[str, list]:
    calls = {name: [] for name in names}
    for name in names:  # the decode linears in fp8_linear, the quantizers in dispatch
        module = (
            quantized_linear.fp8_linear
            if hasattr(quantized_linear.fp8_linear, name)
            else quantized_linear.dispatch
        )
        real = getattr(module, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            calls[_name].append((args, kwargs))
            return _real(*args, **kwargs)

        monkeypatch.setattr(module, name, spy)
    return calls


EXPERT_PATHS = ("fp8_grouped_w8a8_linear", "fp8_grouped_weight_only_linear", "dequantize_fp8_blockwise")


@pytest.mark.parametrize("pow2", [False, True])
def test_a_decode_step_of_many_rows_an_expert_multiplies_codes_by_codes(monkeypatch, gpu_condition, pow2):
    """At `W8A8_MIN_MEAN_ROWS` rows an expert and above: each token's input quantized once, gate+up one call
    on its stack reading the routed rows' tokens through the routing's `token` index, down one call
    on the codes of `silu * up`; no weight-only kernel, no dequantized weight; the loop's result
    within bf16 rounding where the scales are powers of two (equal values up to summation order),
    within a few codes' worth with fp32 scales."""
    gen = torch.Generator().manual_seed(30)
    experts = _experts(gen, _cfg(pow2))
    tokens = 40
    assert tokens * TOP_K >= quantized_linear.W8A8_MIN_MEAN_ROWS * E
    hidden, index, weights = _routing(gen, tokens)
    loop = experts(hidden, index, weights).float()
    calls = _record(monkeypatch, EXPERT_PATHS)
    with quantized_linear.decode_step():
        step = experts._grouped_forward(hidden, index, weights).float()
    w8a8 = calls["fp8_grouped_w8a8_linear"]
    assert calls["fp8_grouped_weight_only_linear"] == [] and calls["dequantize_fp8_blockwise"] == []
    assert [args[2] is experts.stacked[p][0] for (args, _), p in zip(w8a8, ("gate_up_proj", "down_proj"), strict=True)] == [
        True, True
    ]  # fmt: skip
    (gu_args, gu_kwargs), (down_args, down_kwargs) = w8a8
    assert gu_args[0].shape == (tokens, H)  # the tokens' codes, once each
    assert torch.equal(gu_kwargs["index"], index.flatten().argsort(stable=True) // TOP_K)
    assert down_kwargs.get("index") is None and down_args[0].shape == (tokens * TOP_K, INTER)
    # power-of-two scales: the codes times the scales are the fake-quantized values, so only the
    # summation order differs from the loop; fp32 scales: the loop multiplies bf16(q * s) on both
    # sides, and the down projection's input quantization turns those roundings into whole codes
    assert float((step - loop).norm() / loop.norm()) < (1e-3 if pow2 else 3e-2)
    # the same forward outside a decode step (a prefill of <= DECODE_MAX_ROWS tokens): the weight-only
    # kernel, which multiplies the fake-quantized values, not codes by codes
    calls["fp8_grouped_w8a8_linear"].clear()
    experts._grouped_forward(hidden, index, weights)
    assert calls["fp8_grouped_w8a8_linear"] == [] and len(calls["fp8_grouped_weight_only_linear"]) == 2


def test_fewer_rows_an_expert_keep_the_weight_only_kernel(monkeypatch, gpu_condition):
    gen = torch.Generator().manual_seed(31)
    experts = _experts(gen, _cfg())
    tokens = quantized_linear.W8A8_MIN_MEAN_ROWS * E // TOP_K - 1  # just below the limit
    hidden, index, weights = _routing(gen, tokens)
    calls = _record(monkeypatch, EXPERT_PATHS)
    with quantized_linear.decode_step():
        experts._grouped_forward(hidden, index, weights)
    assert calls["fp8_grouped_w8a8_linear"] == [] and len(calls["fp8_grouped_weight_only_linear"]) == 2


def test_no_codes_by_codes_without_the_gpu_or_an_fp8_activation_quantizer(monkeypatch):
    gen = torch.Generator().manual_seed(32)
    hidden, index, weights = _routing(gen, 60)
    for experts, available in (
        (_experts(gen, _cfg(), activation=False), True),
        (_experts(gen, _cfg()), False),
    ):
        monkeypatch.setattr(
            quantized_linear.fp8_linear, "w8a8_kernel_available", lambda device, a=available: a
        )
        assert (w8a8_quantizer(experts[0].gate_proj, hidden.device) is None) is True
        calls = _record(monkeypatch, EXPERT_PATHS)
        with quantized_linear.decode_step():
            experts._grouped_forward(hidden, index, weights)
        assert calls["fp8_grouped_w8a8_linear"] == [] and len(calls["fp8_grouped_weight_only_linear"]) == 2
        monkeypatch.undo()


def test_the_engines_switch_turns_codes_by_codes_off(monkeypatch, gpu_condition):
    """`WireLinear.codes_decode` false (`rollout.fp8_codes_decode=false`): the weight-only kernel."""
    gen = torch.Generator().manual_seed(36)
    experts = _experts(gen, _cfg())
    for expert in experts:
        for proj in WireExperts.PROJECTIONS:
            getattr(expert, proj).codes_decode = False
    hidden, index, weights = _routing(gen, 40)
    calls = _record(monkeypatch, EXPERT_PATHS)
    with quantized_linear.decode_step():
        experts._grouped_forward(hidden, index, weights)
    assert calls["fp8_grouped_w8a8_linear"] == [] and len(calls["fp8_grouped_weight_only_linear"]) == 2


def test_the_quantizer_wants_128_column_tiles_and_128_by_128_weight_blocks(monkeypatch):
    monkeypatch.setattr(quantized_linear.fp8_linear, "w8a8_kernel_available", lambda device: True)
    gen = torch.Generator().manual_seed(33)
    lin = _linear(_cfg(), "model.layers.0.mlp.down_proj.weight", (128, 256), gen, role=Role.dense_mlp)
    assert w8a8_quantizer(lin, torch.device("cpu")) == Fp8ActivationQuant(128, False)
    lin.activation = Fp8ActivationQuant(64, False)
    assert w8a8_quantizer(lin, torch.device("cpu")) is None
    bf16 = torch.nn.Linear(256, 128, bias=False, dtype=torch.bfloat16)
    assert w8a8_quantizer(bf16, torch.device("cpu")) is None


def test_a_dense_linear_in_a_large_decode_step_multiplies_codes_by_codes(monkeypatch, gpu_condition):
    gen = torch.Generator().manual_seed(34)
    lin = _linear(_cfg(), "model.layers.0.mlp.down_proj.weight", (192, 256), gen, role=Role.dense_mlp)
    x = torch.randn(2, 40, 256, generator=gen).to(torch.bfloat16)  # 80 rows > DECODE_MAX_ROWS
    own = lin(x).float()
    calls = _record(monkeypatch, ("fp8_w8a8_linear",))
    with quantized_linear.decode_step():
        step = lin(x)
    assert step.shape == (2, 40, 192) and step.dtype == torch.bfloat16
    ((args, _),) = calls["fp8_w8a8_linear"]
    assert args[2] is lin.get_buffer("weight") and args[0].shape == (80, 256)
    assert float((step.float() - own).norm() / own.norm()) < 1e-2
    lin(x[:, :30])  # 60 rows, or outside a step: the weight-only / dequantized paths
    lin(x)
    assert len(calls["fp8_w8a8_linear"]) == 1


def test_shared_q_k_v_in_a_large_decode_step_are_one_codes_by_codes_call(monkeypatch, gpu_condition):
    gen = torch.Generator().manual_seed(35)
    cfg = _cfg()
    members = [
        _linear(cfg, f"model.layers.0.self_attn.{p}.weight", (n, H), gen, role=Role.attention)
        for p, n in (("q_proj", 256), ("k_proj", 128), ("v_proj", 128))
    ]
    x = torch.randn(70, H, generator=gen).to(torch.bfloat16)
    own = [m(x).float() for m in members]
    group = SharedInput(members)
    monkeypatch.setattr(SharedInput, "applies", lambda self, x: True)  # CUDA's condition
    calls = _record(monkeypatch, ("fp8_w8a8_linear",))
    with quantized_linear.decode_step():
        outs = [m(x) for m in members]
    ((args, _),) = calls["fp8_w8a8_linear"]
    assert args[2] is group.weight and args[3] is group.scale
    for got, ref in zip(outs, own, strict=True):
        assert float((got.float() - ref).norm() / ref.norm()) < 1e-2
