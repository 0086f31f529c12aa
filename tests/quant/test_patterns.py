"""Ignore-list semantics against compressed-tensors' own matcher (the oracle engines share)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from compressed_tensors.utils.match import match_name, match_named_modules
from hypothesis import given
from hypothesis import strategies as st

from skyq.config.enums import ModelFamily, Precision, QuantScope
from skyq.config.schema import ModelConfig, PrecisionConfig
from skyq.quant import patterns
from skyq.quant.plan import build_plan

NAMES = [
    "model.layers.0.mlp.gate",
    "model.layers.0.mlp.gate_proj",
    "model.layers.0.mlp.experts.3.gate_proj",
    "model.layers.0.mlp.experts.gate_up_proj",
    "model.layers.12.mlp.shared_expert_gate",
    "model.layers.1.self_attn.q_proj",
    "language_model.lm_head",
    "lm_head",
    "vision_tower.encoder.blocks.0.wqkv",
]
ENTRIES = [
    "lm_head",
    "model.layers.0.mlp.gate",
    r"re:.*mlp\.gate$",
    r"re:.*mlp\.gate\.*",  # pitfall P11: `\.*` allows zero dots, so it also catches gate_proj
    r"re:.*self_attn.*",
    r"re:^model\.layers\.\d+\.mlp\.gate$",
    r"re:vision_tower",
    "re:lm_head",
]


@pytest.mark.parametrize("entry", ENTRIES)
def test_matches_agrees_with_compressed_tensors_match_name(entry):
    for name in NAMES:
        assert patterns.matches(name, entry) == match_name(name, entry), (name, entry)


@given(
    name=st.lists(st.sampled_from(["model", "layers", "0", "17", "mlp", "gate", "gate_proj", "experts"]),
                  min_size=1, max_size=6).map(".".join),
    entry=st.sampled_from(ENTRIES + ["model.layers.0.mlp.gate_proj", r"re:model\.layers\.\d+", "re:.*experts"]),
)  # fmt: skip
def test_matches_agrees_with_compressed_tensors_on_generated_names(name, entry):
    assert patterns.matches(name, entry) == match_name(name, entry)


def test_a_router_template_never_catches_gate_proj():
    router = patterns.template_regex(patterns.template("model.layers.5.mlp.gate"))
    assert router == r"re:^model\.layers\.\d+\.mlp\.gate$"
    for name in ("model.layers.5.mlp.gate_proj", "model.layers.5.mlp.experts.1.gate_proj",
                 "model.layers.5.mlp.experts.gate_up_proj", "model.layers.5.mlp.gate.extra"):  # fmt: skip
        assert not match_name(name, router) and not patterns.matches(name, router)
    assert match_name("model.layers.41.mlp.gate", router)
    # The loose pattern some tools emit does catch gate_proj: the reason templates are anchored.
    assert match_name("model.layers.5.mlp.gate_proj", r"re:.*mlp\.gate\.*")


def test_templates_generalize_index_segments_only():
    assert patterns.template("a.layers.3.mlp.experts.17.up_proj") == "a.layers.*.mlp.experts.*.up_proj"
    assert patterns.template("a.layers.3.mlp.experts.17.up_proj", True) == "a.layers.3.mlp.experts.*.up_proj"
    assert patterns.template("mm_projector.proj.2") == "mm_projector.proj.*"
    assert patterns.template("blocks.fc0.a1") == "blocks.fc0.a1"


def test_entries_naming_parameters_or_broken_regexes_are_refused():
    with pytest.raises(patterns.IgnorePatternError, match="module names"):
        patterns.check_entries(["model.layers.0.mlp.gate.weight"])
    with pytest.raises(patterns.IgnorePatternError, match="module names"):
        patterns.check_entries([r"re:.*\.mlp\.gate\.weight$"])
    with pytest.raises(patterns.IgnorePatternError, match="not a valid regex"):
        patterns.check_entries(["re:model.(layers"])


def module_tree(linear_names: list[str]) -> torch.nn.Module:
    """A module tree holding an nn.Linear at every given dotted name (what an engine would build)."""
    root = torch.nn.Module()
    for name in linear_names:
        parent = root
        *path, leaf = name.split(".")
        for part in path:
            if not hasattr(parent, part):
                parent.add_module(part, torch.nn.Module())
            parent = getattr(parent, part)
        parent.add_module(leaf, torch.nn.Linear(1, 1, bias=False))
    return root


DSV3_MM = ModelConfig(
    family=ModelFamily.deepseek_v3, vocab_size=40, hidden_size=64, num_layers=3, num_attention_heads=2,
    num_key_value_heads=2, intermediate_size=96, moe_intermediate_size=32, num_experts=4, num_shared_experts=1,
    first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16,
    v_head_dim=16, num_nextn_predict_layers=1, text_prefix="language_model.", vision_num_layers=2,
    vision_hidden_size=32, vision_intermediate_size=64,
)  # fmt: skip
QWEN = ModelConfig(family=ModelFamily.qwen3_moe, hidden_size=64, moe_intermediate_size=32, num_experts=4)


@pytest.mark.parametrize(
    ("model_cfg", "precision_cfg"),
    [
        (QWEN, PrecisionConfig(name=Precision.int4_qat, int4_group_size=32)),
        (QWEN, PrecisionConfig(name=Precision.mxfp8, mxfp8_targets=QuantScope.all_linear)),
        (DSV3_MM, PrecisionConfig(name=Precision.int4_qat, int4_group_size=32)),
        (
            DSV3_MM,
            PrecisionConfig(name=Precision.int4_qat, int4_group_size=16, qat_scope=QuantScope.all_linear),
        ),
        (dataclasses.replace(DSV3_MM, num_nextn_predict_layers=0), PrecisionConfig(name=Precision.mxfp8)),
    ],
    ids=["qwen-int4", "qwen-mxfp8-all", "dsv3-mtp-vision-int4", "dsv3-int4-all-linear", "dsv3-mxfp8"],
)
def test_compressed_tensors_quantizes_exactly_the_plans_modules_under_our_ignore_list(
    model_cfg, precision_cfg
):
    plan = build_plan(model_cfg, precision_cfg)
    quantized, kept = plan.quantized_modules(), plan.unquantized_linear_modules()
    ignore = plan.ignore_list()
    tree = module_tree(quantized + kept)
    selected = sorted(name for name, _ in match_named_modules(tree, ["Linear"], ignore))
    assert selected == quantized
    assert plan.check_ignore_list(ignore) == []
    assert all(e.startswith("re:^") and e.endswith("$") or "." not in e or e in kept for e in ignore)


def test_mtp_experts_next_to_quantized_experts_keep_their_layer_index_literal():
    plan = build_plan(DSV3_MM, PrecisionConfig(name=Precision.int4_qat, int4_group_size=32))
    ignore = plan.ignore_list()
    mtp_experts = r"re:^language_model\.model\.layers\.3\.mlp\.experts\.\d+\.gate_proj$"
    assert mtp_experts in ignore
    assert r"re:^language_model\.model\.layers\.\d+\.mlp\.experts\.\d+\.gate_proj$" not in ignore


def test_check_ignore_list_reports_both_directions():
    plan = build_plan(QWEN, PrecisionConfig(name=Precision.int4_qat, int4_group_size=32))
    problems = plan.check_ignore_list(["lm_head", "re:.*gate"])  # catches routers and gate_proj alike
    assert any(
        p.startswith("model.layers.0.mlp.experts.0.gate_proj: quantized by the plan") for p in problems
    )
    assert any(p.startswith("model.layers.1.self_attn.q_proj: kept bf16") for p in problems)
    assert not any(p.startswith("model.layers.0.mlp.gate:") for p in problems)
    assert not any(p.startswith("model.layers.0.mlp.experts.0.up_proj") for p in problems)
