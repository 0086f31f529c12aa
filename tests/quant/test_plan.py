"""The quantization plan of the real model configs: counts from the architecture, determinism, JSON,
diff, byte accounting and shape refusals."""

from __future__ import annotations

import dataclasses
import math
import time

import pytest
from omegaconf import OmegaConf

from skyq.config.enums import Int4Grid, ModelFamily, Precision
from skyq.config.schema import ModelConfig, PrecisionConfig
from skyq.config.store import compose
from skyq.quant.errors import QuantizationError
from skyq.quant.layouts import Role
from skyq.quant.plan import PlanError, QuantPlan, build_plan


def composed(model: str, precision: str, *overrides: str):
    cfg = OmegaConf.to_object(compose([f"model={model}", f"precision={precision}", *overrides]))
    return cfg.model, cfg.precision


@pytest.fixture(scope="module")
def qwen_int4() -> QuantPlan:
    return build_plan(*composed("qwen3_30b", "int4_qat", "precision.int4_group_size=128"))


@pytest.fixture(scope="module")
def kimi_int4() -> QuantPlan:
    return build_plan(*composed("kimi_k26", "int4_qat", "precision.int4_group_size=32"))


def test_qwen3_30b_int4_quantizes_exactly_the_routed_experts(qwen_int4):
    quantized = [p for p in qwen_int4 if p.quantized]
    assert len(quantized) == 48 * 128 * 3
    assert {p.role for p in quantized} == {Role.routed_expert}
    assert {p.format for p in quantized} == {"int4"} and {p.block for p in quantized} == {(1, 128)}
    assert all(not p.quantized for p in qwen_int4 if p.role is not Role.routed_expert)
    gate = qwen_int4["model.layers.47.mlp.experts.127.gate_proj.weight"]
    assert [(w.name.rsplit(".", 1)[1], w.shape) for w in gate.wire] == [
        ("weight_packed", (768, 2048 // 8)), ("weight_scale", (768, 2048 // 128)), ("weight_shape", (2,)),
    ]  # fmt: skip


def test_qwen3_30b_wire_bytes_from_the_architecture(qwen_int4):
    v, h, layers, e, i = 151936, 2048, 48, 128, 768
    attention = 2 * h * (32 * 128) + 2 * h * (4 * 128)
    norms = 2 * h + 2 * 128
    bf16_params = 2 * v * h + h + layers * (attention + norms + e * h) + layers * e * 3 * i * h
    assert qwen_int4.bf16_bytes == 2 * bf16_params
    expert_int4 = i * h // 2 + (i * h // 128) * 2 + 16  # packed nibbles, bf16 scales, int64[2] shape
    assert qwen_int4.wire_bytes == qwen_int4.bf16_bytes - layers * e * 3 * (2 * i * h - expert_int4)


def test_qwen3_30b_fp8_blockwise_adds_attention_and_skips_router_norms_embeddings_lm_head():
    plan = build_plan(*composed("qwen3_30b", "fp8_blockwise"))
    quantized = [p for p in plan if p.quantized]
    assert len(quantized) == 48 * 128 * 3 + 48 * 4
    assert {p.role for p in quantized} == {Role.routed_expert, Role.attention}
    for name in ("model.layers.3.mlp.gate.weight", "model.layers.3.input_layernorm.weight",
                 "model.layers.3.self_attn.q_norm.weight", "model.embed_tokens.weight", "lm_head.weight"):  # fmt: skip
        assert not plan[name].quantized and plan[name].wire[0].name == name
    scale = plan["model.layers.0.mlp.experts.0.down_proj.weight"].wire[1]
    assert (scale.name, scale.shape) == ("model.layers.0.mlp.experts.0.down_proj.weight_scale_inv", (16, 6))
    assert plan["model.layers.0.self_attn.k_proj.weight"].wire[1].shape == (4, 16)


def test_kimi_k26_int4_keeps_vision_dense_shared_attention_and_router_bias_unquantized(kimi_int4):
    quantized = [p for p in kimi_int4 if p.quantized]
    assert len(quantized) == 60 * 384 * 3
    assert {p.role for p in quantized} == {Role.routed_expert}
    assert not any(p.name.startswith("language_model.model.layers.0.") for p in quantized)  # dense layer 0
    kept = {p.role for p in kimi_int4 if not p.quantized}
    assert {Role.vision, Role.dense_mlp, Role.shared_expert, Role.attention, Role.router_bias} <= kept
    vision = [p for p in kimi_int4 if p.name.startswith(("vision_tower.", "mm_projector."))]
    assert len(vision) == 3 + 27 * 12 + 2 + 6 and not any(p.quantized for p in vision)
    bias = kimi_int4["language_model.model.layers.1.mlp.gate.e_score_correction_bias"]
    assert [(w.shape, str(w.dtype)) for w in bias.wire] == [((384,), "torch.float32")]
    # The public K2.5/K2.6 release stores expert gate_proj as packed [2048, 896] int32 + [2048, 224] bf16.
    gate = kimi_int4["language_model.model.layers.1.mlp.experts.0.gate_proj.weight"]
    assert [(w.shape, str(w.dtype)) for w in gate.wire][:2] == [
        ((2048, 896), "torch.int32"),
        ((2048, 224), "torch.bfloat16"),
    ]


def test_kimi_ignore_list_covers_the_unquantized_linears_only(kimi_int4):
    ignore = kimi_int4.ignore_list()
    assert kimi_int4.check_ignore_list(ignore) == []
    assert "language_model.lm_head" in ignore
    assert r"re:^vision_tower\.encoder\.blocks\.\d+\.wqkv$" in ignore
    assert r"re:^mm_projector\.proj\.\d+$" in ignore
    # A K2-Thinking-style list written for a text-only checkpoint misses K2.6's prefix and vision tower.
    text_only = [
        "lm_head",
        r"re:.*self_attn.*",
        r"re:.*shared_experts.*",
        r"re:.*mlp\.(gate|up|gate_up|down)_proj.*",
    ]
    problems = kimi_int4.check_ignore_list(text_only)
    assert any(p.startswith("language_model.lm_head: kept bf16") for p in problems)
    assert any(p.startswith("vision_tower.encoder.blocks.0.wqkv: kept bf16") for p in problems)
    assert any(p.startswith("language_model.model.layers.1.mlp.gate: kept bf16") for p in problems)


def test_the_kimi_plan_is_built_and_summarized_quickly():
    model_cfg, precision_cfg = composed("kimi_k26", "int4_qat", "precision.int4_group_size=32")
    start = time.perf_counter()
    summary = build_plan(model_cfg, precision_cfg).summary()
    elapsed = time.perf_counter() - start
    assert "routed_expert" in summary and "69120" in summary
    assert elapsed < 6.0, f"{elapsed:.2f}s (target < 2 s on an idle machine)"


def test_plans_are_deterministic_and_json_round_trips():
    model_cfg, precision_cfg = composed("tiny_moe", "fp8_blockwise")
    a, b = build_plan(model_cfg, precision_cfg), build_plan(model_cfg, precision_cfg)
    assert a == b and a.to_json() == b.to_json()
    back = QuantPlan.from_json(a.to_json())
    assert back == a and back.diff(a) == [] and back.to_json() == a.to_json()
    assert [p.wire for p in back] == [p.wire for p in a]


def test_from_json_refuses_what_is_not_a_plan():
    with pytest.raises(PlanError, match="not a skyq quantization plan"):
        QuantPlan.from_json('{"version": 1}')
    text = (
        build_plan(*composed("tiny_moe", "bf16"))
        .to_json()
        .replace('"torch.bfloat16"', '"torch.complex64"', 1)
    )
    with pytest.raises(PlanError, match="complex64"):
        QuantPlan.from_json(text)


def test_diff_names_the_changed_parameter_and_the_changed_settings():
    model_cfg, precision_cfg = composed("tiny_moe", "int4_qat", "precision.int4_group_size=32")
    plan = build_plan(model_cfg, precision_cfg)
    name = "model.layers.1.mlp.experts.2.up_proj.weight"
    params = tuple(p._replace(quantized=False) if p.name == name else p for p in plan)
    changed = dataclasses.replace(plan, params=params)
    lines = plan.diff(changed)
    assert len(lines) == 1 and lines[0].startswith(f"{name}: quantized True != False")
    other = build_plan(
        model_cfg, dataclasses.replace(precision_cfg, int4_grid=Int4Grid.rtn, int4_group_size=16)
    )
    lines = plan.diff(other)
    assert lines[0].startswith("settings: ")
    assert any("block (1, 32) != (1, 16)" in line for line in lines)
    assert lines[-1].startswith("... and ") and len(lines) == 1 + 20 + 1
    fewer = build_plan(dataclasses.replace(model_cfg, num_layers=1), precision_cfg)
    assert any(line.endswith(": only in tiny_moe") for line in plan.diff(fewer))


def test_summary_counts_roles_and_compares_bytes():
    plan = build_plan(*composed("tiny_moe", "int4_qat", "precision.int4_group_size=32"))
    summary = plan.summary()
    n_experts = 2 * 4 * 3  # tiny_moe: 2 layers x 4 experts x 3 projections
    rows = {line.split()[0]: line.split()[1:] for line in summary.splitlines()[3:-1]}
    assert rows["routed_expert"] == [str(n_experts), str(n_experts), "0", "int4"]
    assert rows["router"] == ["2", "0", "2", "bf16"] and rows["total"] == ["45", "24", "21"]
    assert plan.counts_by_role()[Role.router] == (2, 0)
    assert f"({plan.wire_bytes / plan.bf16_bytes:.3f}x)" in summary


def test_shapes_a_format_cannot_take_are_refused_at_plan_time():
    tiny, int4_128 = composed("tiny_moe", "int4_qat", "precision.int4_group_size=128")
    with pytest.raises(
        QuantizationError,
        match=r"experts\.0\.gate_proj\.weight: INT4 needs K % group_size == 0, but K = 64 = 0 \* 128 \+ 64",
    ):
        build_plan(tiny, int4_128)
    odd = ModelConfig(family=ModelFamily.qwen3_moe, hidden_size=64, moe_intermediate_size=40, num_experts=2)
    with pytest.raises(
        QuantizationError, match=r"down_proj\.weight: MXFP8 needs K % 32 == 0, but K = 40 = 1 \* 32 \+ 8"
    ):
        build_plan(odd, PrecisionConfig(name=Precision.mxfp8))


def test_unknown_names_are_a_plan_error(qwen_int4):
    assert "lm_head.weight" in qwen_int4 and "lm_head.bias" not in qwen_int4
    with pytest.raises(PlanError, match="lm_head.bias"):
        qwen_int4["lm_head.bias"]
    assert math.isclose(qwen_int4.wire_bytes / qwen_int4.bf16_bytes, 0.3, abs_tol=0.05)
