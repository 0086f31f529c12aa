"""Strategies: scope per precision, wire tensors bit-identical to the format functions, fake-quant of
fused experts equal to what the engine dequantizes, engine configs the compressed-tensors oracle accepts."""

from __future__ import annotations

import pytest
import torch
from compressed_tensors.quantization import QuantizationConfig

from skyq.config.enums import Fp8Recipe, Int4Grid, ModelFamily, Precision, QuantScope, ScaleFormat
from skyq.config.schema import ModelConfig, PrecisionConfig
from skyq.quant import fp8_blockwise, int4, mxfp8
from skyq.quant.errors import QuantizationError
from skyq.quant.layouts import Role, get_layout
from skyq.quant.plan import build_plan
from skyq.quant.strategies import StrategyError, get_strategy

ALL_LINEAR = {Role.routed_expert, Role.shared_expert, Role.attention, Role.dense_mlp}


def strategy(name: Precision, **kw):
    return get_strategy(PrecisionConfig(name=name, **kw))


def test_every_precision_has_a_strategy_built_from_its_config():
    for precision in Precision:
        assert strategy(precision).precision is precision
    with pytest.raises(StrategyError, match="precision.name=mxfp8"):
        type(strategy(Precision.int4_qat))(PrecisionConfig(name=Precision.mxfp8))


@pytest.mark.parametrize(
    ("precision_cfg", "expected"),
    [
        (PrecisionConfig(name=Precision.bf16), set()),
        (PrecisionConfig(name=Precision.fp8_blockwise), ALL_LINEAR),
        (
            PrecisionConfig(name=Precision.fp8_blockwise, fp8_targets=QuantScope.routed_experts),
            {Role.routed_expert},
        ),
        (PrecisionConfig(name=Precision.mxfp8), {Role.routed_expert}),
        (PrecisionConfig(name=Precision.mxfp8, mxfp8_targets=QuantScope.all_linear), ALL_LINEAR),
        (PrecisionConfig(name=Precision.int4_qat), {Role.routed_expert}),
        (PrecisionConfig(name=Precision.int4_qat, qat_scope=QuantScope.all_linear), ALL_LINEAR),
    ],
)
def test_scope_per_precision_never_includes_router_norms_embeddings_vision_or_mtp(precision_cfg, expected):
    s = get_strategy(precision_cfg)
    assert {role for role in Role if s.quantizes(role)} == expected
    assert not s.quantizes_param("m.layers.0.mlp.experts.0.down_proj.bias", (64,), Role.routed_expert)


def fresh(gen, *shape, dtype=torch.bfloat16):
    return (torch.randn(*shape, generator=gen) * torch.rand(1, generator=gen) * 10).to(dtype)


@pytest.mark.parametrize("shape", [(64, 128), (200, 300), (1, 160), (130, 32), (256, 256)])
@pytest.mark.parametrize("scale_format", [ScaleFormat.fp32, ScaleFormat.ue8m0])
def test_fp8_serialize_deserialize_equals_the_format_functions(gen, shape, scale_format):
    s = strategy(Precision.fp8_blockwise, scale_format=scale_format, block_size=[128, 64])
    w = fresh(gen, *shape)
    wire = s.serialize("x.weight", w, role=Role.attention)
    q, scale_inv = fp8_blockwise.quantize(
        w, block_size=(128, 64), pow2_scale=scale_format is ScaleFormat.ue8m0
    )
    assert sorted(wire) == ["x.weight", "x.weight_scale_inv"]
    assert torch.equal(wire["x.weight"].view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(wire["x.weight_scale_inv"], scale_inv)
    expected = fp8_blockwise.dequantize(q, scale_inv, block_size=(128, 64), dtype=torch.bfloat16)
    assert torch.equal(s.deserialize("x.weight", wire, role=Role.attention), expected)
    if scale_format is ScaleFormat.ue8m0:  # `scale_fmt: ue8m0` is only written over real powers of two
        mantissa = wire["x.weight_scale_inv"].view(torch.int32) & 0x7FFFFF
        assert int(mantissa.count_nonzero()) == 0


@pytest.mark.parametrize("shape", [(64, 128), (3, 96), (1, 32), (130, 256)])
def test_mxfp8_serialize_deserialize_equals_the_format_functions(gen, shape):
    s = strategy(Precision.mxfp8)
    w = fresh(gen, *shape)
    wire = s.serialize("e.weight", w, role=Role.routed_expert)
    q, scale = mxfp8.quantize(w)
    assert torch.equal(wire["e.weight"].view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(wire["e.weight_scale"], scale) and wire["e.weight_scale"].dtype == torch.uint8
    assert torch.equal(s.deserialize("e.weight", wire, role=Role.routed_expert), mxfp8.dequantize(q, scale))


@pytest.mark.parametrize("grid", [Int4Grid.kimi, Int4Grid.rtn])
@pytest.mark.parametrize(
    ("shape", "group"), [((64, 128), 32), ((48, 256), 128), ((1, 64), 64), ((7, 96), 32)]
)
def test_int4_serialize_deserialize_equals_the_format_functions(gen, grid, shape, group):
    s = strategy(Precision.int4_qat, int4_group_size=group, int4_grid=grid)
    w = fresh(gen, *shape)
    wire = s.serialize("e.weight", w, role=Role.routed_expert)
    q, scale = int4.quantize(w, group_size=group, grid=grid)
    assert sorted(wire) == ["e.weight_packed", "e.weight_scale", "e.weight_shape"]
    assert torch.equal(wire["e.weight_packed"], int4.pack(q))
    assert torch.equal(wire["e.weight_scale"], scale) and scale.dtype == torch.bfloat16
    assert wire["e.weight_shape"].tolist() == list(shape) and wire["e.weight_shape"].dtype == torch.int64
    expected = int4.dequantize(q, scale, group_size=group)
    assert torch.equal(s.deserialize("e.weight", wire, role=Role.routed_expert), expected)


def test_shapes_a_format_cannot_take_are_refused_with_the_arithmetic(gen):
    with pytest.raises(
        QuantizationError, match=r"layers\.0\.x\.weight: MXFP8 needs K % 32 == 0, but K = 100 = 3 \* 32 \+ 4"
    ):
        strategy(Precision.mxfp8).serialize("layers.0.x.weight", fresh(gen, 8, 100), role=Role.routed_expert)
    with pytest.raises(
        QuantizationError, match=r"e\.weight: INT4 needs K % group_size == 0, but K = 96 = 1 \* 64 \+ 32"
    ):
        strategy(Precision.int4_qat, int4_group_size=64).serialize(
            "e.weight", fresh(gen, 8, 96), role=Role.routed_expert
        )


def test_unquantized_tensors_pass_through_in_their_checkpoint_dtype(gen):
    s = strategy(Precision.int4_qat, int4_group_size=32)
    router = fresh(gen, 4, 64, dtype=torch.float32)
    wire = s.serialize("m.layers.1.mlp.gate.weight", router, role=Role.router)
    assert (
        list(wire) == ["m.layers.1.mlp.gate.weight"]
        and wire["m.layers.1.mlp.gate.weight"].dtype == torch.bfloat16
    )
    bias = fresh(gen, 4, dtype=torch.float32)
    wire = s.serialize("m.layers.1.mlp.gate.e_score_correction_bias", bias, role=Role.router_bias)
    assert torch.equal(wire["m.layers.1.mlp.gate.e_score_correction_bias"], bias)  # fp32 kept bit for bit
    assert s.deserialize("m.layers.1.mlp.gate.e_score_correction_bias", wire, role=Role.router_bias) is bias


def test_a_weight_without_its_scale_is_refused(gen):
    s = strategy(Precision.fp8_blockwise)
    wire = s.serialize("x.weight", fresh(gen, 16, 16), role=Role.attention)
    scale = wire.pop("x.weight_scale_inv")
    with pytest.raises(QuantizationError, match=r"x.weight \(attention\).*x.weight_scale_inv"):
        s.deserialize("x.weight", wire, role=Role.attention)  # e4m3 codes alone are never read as bf16
    with pytest.raises(QuantizationError, match="got.*x.weight_extra"):
        s.deserialize(
            "x.weight", {**wire, "x.weight_scale_inv": scale, "x.weight_extra": scale}, role=Role.attention
        )
    with pytest.raises(QuantizationError, match="weight_scale"):
        strategy(Precision.int4_qat).deserialize(
            "e.weight", {"e.weight_packed": torch.zeros(1, dtype=torch.int32)}, role=Role.routed_expert
        )
    with pytest.raises(
        QuantizationError, match=r"router\): int4_qat wire tensors must be exactly \['m.gate.weight'\]"
    ):
        strategy(Precision.int4_qat).deserialize(
            "m.gate.weight", {"m.gate.weight_packed": scale}, role=Role.router
        )


QWEN = ModelConfig(
    family=ModelFamily.qwen3_moe, hidden_size=256, moe_intermediate_size=96, num_experts=3, num_layers=1,
    num_attention_heads=4, num_key_value_heads=2, head_dim=64,
)  # fmt: skip
FUSED_CASES = [
    PrecisionConfig(name=Precision.fp8_blockwise),
    PrecisionConfig(name=Precision.fp8_blockwise, scale_format=ScaleFormat.ue8m0, block_size=[64, 128]),
    PrecisionConfig(name=Precision.mxfp8),
    PrecisionConfig(name=Precision.int4_qat, int4_group_size=32),
    PrecisionConfig(name=Precision.int4_qat, int4_group_size=32, int4_grid=Int4Grid.rtn),
]


@pytest.mark.parametrize(
    "precision_cfg", FUSED_CASES, ids=lambda c: f"{c.name.value}-{c.scale_format.value}-{c.int4_grid.value}"
)
@pytest.mark.parametrize("leaf", ["gate_up_proj", "down_proj"])
def test_fake_quant_of_a_fused_expert_tensor_equals_the_engines_dequant_of_the_split_tensors(
    gen, precision_cfg, leaf
):
    s, layout = get_strategy(precision_cfg), get_layout(QWEN.family)
    name = f"model.layers.0.mlp.experts.{leaf}"
    e, h, i = QWEN.num_experts, QWEN.hidden_size, QWEN.moe_intermediate_size
    fused = fresh(gen, *((e, 2 * i, h) if leaf == "gate_up_proj" else (e, h, i)))
    # Distinct magnitudes per expert and projection: a block straddling two of them changes the result.
    fused = fused * torch.linspace(0.01, 50.0, fused.shape[0] * fused.shape[1]).view(
        fused.shape[:2] + (1,)
    ).to(fused.dtype)
    trained = s.fake_quant_param(name, fused, layout=layout, model_cfg=QWEN)
    assert trained.dtype == fused.dtype and trained.shape == fused.shape
    served = {
        hf_name: s.deserialize(
            hf_name, s.serialize(hf_name, hf_tensor, role=Role.routed_expert), role=Role.routed_expert
        )
        for hf_name, hf_tensor in layout.split_experts({name: fused}, QWEN).items()
    }
    assert layout.split_experts({name: trained}, QWEN).keys() == served.keys()
    for hf_name, tensor in layout.split_experts({name: trained}, QWEN).items():
        assert torch.equal(tensor, served[hf_name]), hf_name
    if (
        precision_cfg.name is Precision.fp8_blockwise
        and precision_cfg.scale_format.value == "fp32"
        and leaf == "gate_up_proj"
    ):
        # I = 96: a block over the fused tensor would mix gate and up rows and give other values.
        assert not torch.equal(s.fake_quant(fused), trained)


def test_fake_quant_param_leaves_unquantized_parameters_alone_and_passes_gradients_straight_through(gen):
    s, layout = strategy(Precision.int4_qat, int4_group_size=32), get_layout(QWEN.family)
    q_proj = fresh(gen, 256, 256)
    assert (
        s.fake_quant_param("model.layers.0.self_attn.q_proj.weight", q_proj, layout=layout, model_cfg=QWEN)
        is q_proj
    )
    router = fresh(gen, 3, 256)
    assert (
        s.fake_quant_param("model.layers.0.mlp.gate.weight", router, layout=layout, model_cfg=QWEN) is router
    )
    down = fresh(gen, 3, 256, 96, dtype=torch.float32).requires_grad_()
    s.fake_quant_param(
        "model.layers.0.mlp.experts.down_proj", down, layout=layout, model_cfg=QWEN
    ).sum().backward()
    assert torch.equal(down.grad, torch.ones_like(down))


def test_fp8_quantization_config_is_the_deepseek_block_schema():
    plan = build_plan(QWEN, PrecisionConfig(name=Precision.fp8_blockwise))
    config = strategy(Precision.fp8_blockwise).quantization_config(plan)
    assert config == {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
        "modules_to_not_convert": ["lm_head", "model.layers.0.mlp.gate"],
    }
    pow2_cfg = PrecisionConfig(name=Precision.fp8_blockwise, scale_format=ScaleFormat.ue8m0)
    assert get_strategy(pow2_cfg).quantization_config(build_plan(QWEN, pow2_cfg))["scale_fmt"] == "ue8m0"
    with pytest.raises(StrategyError, match="built for precision fp8_blockwise"):
        strategy(Precision.mxfp8).quantization_config(plan)


@pytest.mark.parametrize("precision", [Precision.int4_qat, Precision.mxfp8])
def test_compressed_tensors_accepts_our_quantization_config(precision):
    precision_cfg = PrecisionConfig(name=precision, int4_group_size=32)
    plan = build_plan(QWEN, precision_cfg)
    config = get_strategy(precision_cfg).quantization_config(plan)
    parsed = QuantizationConfig.model_validate(config)
    weights = parsed.config_groups["group_0"].weights
    assert parsed.quant_method == "compressed-tensors" and parsed.quantization_status == "compressed"
    assert parsed.ignore == plan.ignore_list() and parsed.config_groups["group_0"].targets == ["Linear"]
    assert weights.symmetric is True and weights.strategy == "group" and weights.dynamic is False
    if precision is Precision.int4_qat:
        assert (parsed.format, weights.num_bits, weights.type, weights.group_size) == (
            "pack-quantized",
            4,
            "int",
            32,
        )
        assert parsed.config_groups["group_0"].input_activations is None
    else:
        assert (parsed.format, weights.num_bits, weights.type, weights.group_size) == (
            "mxfp8-quantized",
            8,
            "float",
            32,
        )
        assert weights.scale_dtype == torch.uint8
        assert parsed.config_groups["group_0"].input_activations.dynamic is True


def test_bf16_has_no_quantization_config_and_no_te_recipe():
    s = strategy(Precision.bf16)
    assert s.quantization_config(build_plan(QWEN, PrecisionConfig())) is None
    assert s.te_recipe_kwargs() is None
    assert s.env_vars(Fp8Recipe.blockwise) == {"trainer": {}, "engine": {}}


def test_te_recipes_are_plain_data():
    assert strategy(Precision.fp8_blockwise).te_recipe_kwargs() == {
        "recipe": "Float8BlockScaling", "fp8_format": "E4M3", "use_f32_scales": True, "fp8_param": False,
    }  # fmt: skip
    assert strategy(Precision.mxfp8).te_recipe_kwargs() == {
        "recipe": "MXFP8BlockScaling",
        "fp8_format": "E4M3",
    }
    assert strategy(Precision.int4_qat).te_recipe_kwargs() is None


def test_env_vars_follow_the_resolved_recipe_and_refuse_what_cannot_work():
    for precision in Precision:
        with pytest.raises(StrategyError, match="auto"):
            strategy(precision).env_vars(Fp8Recipe.auto)
    hopper = strategy(Precision.fp8_blockwise).env_vars(Fp8Recipe.blockwise)
    assert hopper == {
        "trainer": {"NVTE_FP8_BLOCK_SCALING_FP32_SCALES": "1"},
        "engine": {"VLLM_USE_DEEP_GEMM_E8M0": "0"},
    }
    with pytest.raises(StrategyError, match="precision.scale_format=ue8m0"):
        strategy(Precision.fp8_blockwise).env_vars(Fp8Recipe.mxfp8)
    blackwell = strategy(Precision.fp8_blockwise, scale_format=ScaleFormat.ue8m0).env_vars(Fp8Recipe.mxfp8)
    assert blackwell == {
        "trainer": {"NVTE_FP8_BLOCK_SCALING_FP32_SCALES": "0"},
        "engine": {"VLLM_USE_DEEP_GEMM_E8M0": "1"},
    }
    with pytest.raises(StrategyError, match="precision.emulate=true"):
        strategy(Precision.mxfp8).env_vars(Fp8Recipe.blockwise)
    assert strategy(Precision.mxfp8, emulate=True).env_vars(Fp8Recipe.blockwise) == {
        "trainer": {},
        "engine": {},
    }


def _wire_bytes(wire):
    return {
        n: (t.dtype, tuple(t.shape), t.contiguous().view(torch.uint8).reshape(-1)) for n, t in wire.items()
    }


STACK_PRECISIONS = [
    PrecisionConfig(name=Precision.bf16),
    PrecisionConfig(name=Precision.fp8_blockwise, scale_format=ScaleFormat.fp32),
    PrecisionConfig(name=Precision.fp8_blockwise, scale_format=ScaleFormat.ue8m0),
    PrecisionConfig(name=Precision.mxfp8),
    PrecisionConfig(name=Precision.int4_qat, int4_group_size=32),
    PrecisionConfig(name=Precision.int4_qat, int4_group_size=128, int4_grid=Int4Grid.rtn),
]


@pytest.mark.parametrize("precision_cfg", STACK_PRECISIONS)
@pytest.mark.parametrize("shape", [(5, 96, 256), (3, 200, 384)])
def test_serialize_stack_is_bitwise_the_per_tensor_serialize(gen, precision_cfg, shape):
    s = get_strategy(precision_cfg)
    stack = fresh(gen, *shape)
    stack[1] *= 1e-3  # a member on a different scale: no block may be shared across members
    names = [f"model.layers.0.mlp.experts.{i}.up_proj.weight" for i in range(shape[0])]
    batched = s.serialize_stack(names, stack, role=Role.routed_expert)
    assert len(batched) == len(names)
    for i, name in enumerate(names):
        want = _wire_bytes(s.serialize(name, stack[i].clone(), role=Role.routed_expert))
        got = _wire_bytes(batched[i])
        assert got.keys() == want.keys()
        for n in want:
            assert got[n][:2] == want[n][:2], n
            assert torch.equal(got[n][2], want[n][2]), n
    # The whole-tensor form is the same bytes: member i of each wire position is batched[i]'s tensor.
    whole = s.serialize_stack_tensors(names, stack, role=Role.routed_expert)
    assert [len(member_names) for member_names, _ in whole] == [len(names)] * len(batched[0])
    for member_names, t in whole:
        assert t.shape[0] == len(names)
        for i, n in enumerate(member_names):
            assert _wire_bytes({n: t[i]})[n][:2] == _wire_bytes(batched[i])[n][:2], n
            assert torch.equal(_wire_bytes({n: t[i]})[n][2], _wire_bytes(batched[i])[n][2]), n


def test_serialize_stack_refuses_a_stack_its_names_do_not_match(gen):
    s = strategy(Precision.fp8_blockwise)
    with pytest.raises(StrategyError, match="2 names"):
        s.serialize_stack(["a.weight", "b.weight"], fresh(gen, 3, 128, 128), role=Role.routed_expert)


@pytest.mark.parametrize("precision_cfg", STACK_PRECISIONS)
def test_serialize_many_is_bitwise_each_entry_on_its_own(gen, precision_cfg):
    """Matrices, stacks, an unquantized tensor and a stack whose members are not all weights (the
    caller then goes member by member: None), in one call, as a weight sync hands them over."""
    s = get_strategy(precision_cfg)
    experts = tuple(f"model.layers.0.mlp.experts.{i}.up_proj.weight" for i in range(3))
    mixed = ("model.layers.1.mlp.experts.0.up_proj.weight", "model.layers.1.mlp.experts.1.up_proj.bias")
    entries = [
        ("model.layers.0.self_attn.q_proj.weight", fresh(gen, 256, 384), Role.attention),
        (experts, fresh(gen, 3, 96, 256), Role.routed_expert),
        ("model.norm.weight", fresh(gen, 256), Role.norm),
        ("model.layers.0.self_attn.o_proj.weight", fresh(gen, 384, 256).t(), Role.attention),  # strided
        (mixed, fresh(gen, 2, 96, 256), Role.routed_expert),
    ]
    got = s.serialize_many(entries)
    assert len(got) == len(entries)
    for (name, t, role), out in zip(entries, got):
        if isinstance(name, str):
            want = s.serialize(name, t.clone(), role=role)
            assert _wire_bytes(out).keys() == _wire_bytes(want).keys()
            for n, (dtype, shape, raw) in _wire_bytes(want).items():
                assert _wire_bytes(out)[n][:2] == (dtype, shape) and torch.equal(
                    _wire_bytes(out)[n][2], raw
                ), n
            continue
        want = s.serialize_stack_tensors(name, t.clone(), role=role)
        if want is None:
            assert out is None
            continue
        assert [names for names, _ in out] == [names for names, _ in want]
        for (_, a), (_, b) in zip(out, want):
            assert a.dtype == b.dtype and a.shape == b.shape
            assert torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    with pytest.raises(StrategyError, match="2 names"):
        s.serialize_many([(("a.weight", "b.weight"), fresh(gen, 3, 128, 128), Role.routed_expert)])


def test_int4_serialize_many_keeps_its_weight_shape_rows_between_calls(gen):
    """A sync's int4 `weight_shape` tensors are made once per shape (and device), not copied from
    the host every sync; the bytes are those of `serialize`."""
    s = strategy(Precision.int4_qat, int4_group_size=32)
    names = tuple(f"model.layers.0.mlp.experts.{i}.up_proj.weight" for i in range(3))
    entries = [
        ("model.layers.0.mlp.experts.5.up_proj.weight", fresh(gen, 64, 128), Role.routed_expert),
        (names, fresh(gen, 3, 64, 128), Role.routed_expert),
    ]
    first, second = s.serialize_many(entries), s.serialize_many(entries)
    unit_shape = "model.layers.0.mlp.experts.5.up_proj.weight_shape"
    assert first[0][unit_shape] is second[0][unit_shape]
    assert first[0][unit_shape].tolist() == [64, 128]
    assert first[1][2][1] is second[1][2][1] and first[1][2][1].tolist() == [[64, 128]] * 3
    assert first[1][2][0] == tuple(n.replace(".weight", ".weight_shape") for n in names)


@pytest.mark.parametrize("fmt", ["fp8_blockwise", "mxfp8", "int4"])
def test_grouped_quantize_into_given_tensors_gives_the_per_tensor_bits(gen, fmt):
    """`dispatch.*_group(..., out=)` writes each result into the given tensors (views into one byte
    buffer, as a weight sync's buckets) with the bits of the per-tensor call; a wrong place is
    refused before anything is written."""
    from skyq.quant.kernels import dispatch

    ws = [torch.randn(3, 64, 96, generator=gen).to(torch.bfloat16), torch.randn(40, 64, generator=gen)]
    if fmt == "fp8_blockwise":
        group = lambda out=None: dispatch.quantize_fp8_blockwise_group(ws, ["a", "b"], out=out)  # noqa: E731
        want = [dispatch.quantize_fp8_blockwise(w) for w in ws]
    elif fmt == "mxfp8":
        group = lambda out=None: dispatch.quantize_mxfp8_group(ws, ["a", "b"], out=out)  # noqa: E731
        want = [dispatch.quantize_mxfp8(w) for w in ws]
    else:
        group = lambda out=None: dispatch.quantize_int4_packed_group(ws, ["a", "b"], group_size=32, out=out)  # noqa: E731
        want = [dispatch.quantize_int4_packed(w, group_size=32) for w in ws]
    sizes = [t.numel() * t.element_size() for pair in want for t in pair]
    buf = torch.zeros(sum(sizes) + 16 * len(sizes), dtype=torch.uint8)
    views, pos = [], 0
    for n, t in zip(sizes, (t for pair in want for t in pair)):
        views.append(buf[pos : pos + n].view(t.dtype).view(t.shape))
        pos += (n + 15) // 16 * 16
    out = list(zip(views[0::2], views[1::2]))
    assert group(out) == out
    for (q, s), (gq, gs) in zip(want, out):
        assert torch.equal(q.view(torch.uint8), gq.view(torch.uint8)) and torch.equal(s, gs)
    before = buf.clone()
    wrong = [(views[0], views[1]), (views[2][:5], views[3])]
    with pytest.raises(ValueError, match="output"):
        group(wrong)
    assert torch.equal(buf, before)
