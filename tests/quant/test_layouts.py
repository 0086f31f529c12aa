"""Layouts against the real transformers-5 models: names, shapes, dtypes, fused <-> per-expert."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from skyq.config.enums import ModelFamily
from skyq.config.schema import ModelConfig
from skyq.config.store import compose
from skyq.quant.layouts import LayoutError, Role, get_layout
from skyq.quant.layouts.experts import ExpertLayoutError

QWEN_TINY = ModelConfig(
    family=ModelFamily.qwen3_moe, vocab_size=48, hidden_size=64, num_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
)  # fmt: skip
DSV3_TINY = ModelConfig(
    family=ModelFamily.deepseek_v3, vocab_size=48, hidden_size=64, num_layers=3, num_attention_heads=4,
    num_key_value_heads=4, intermediate_size=96, moe_intermediate_size=32, num_experts=4,
    num_experts_per_tok=2, num_shared_experts=1, first_k_dense_replace=1, q_lora_rank=24, kv_lora_rank=16,
    qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
)  # fmt: skip


def hf_qwen(cfg: ModelConfig) -> Qwen3MoeForCausalLM:
    hf = Qwen3MoeConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim, intermediate_size=cfg.intermediate_size,
        moe_intermediate_size=cfg.moe_intermediate_size, num_experts=cfg.num_experts,
        num_experts_per_tok=cfg.num_experts_per_tok, tie_word_embeddings=cfg.tie_word_embeddings,
    )  # fmt: skip
    return Qwen3MoeForCausalLM(hf).to(torch.bfloat16)


def hf_deepseek(cfg: ModelConfig) -> DeepseekV3ForCausalLM:
    hf = DeepseekV3Config(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
        intermediate_size=cfg.intermediate_size, moe_intermediate_size=cfg.moe_intermediate_size,
        n_routed_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
        n_shared_experts=cfg.num_shared_experts, first_k_dense_replace=cfg.first_k_dense_replace,
        q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_nope_head_dim,
        qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim, n_group=1, topk_group=1,
        tie_word_embeddings=cfg.tie_word_embeddings,
    )  # fmt: skip
    model = DeepseekV3ForCausalLM(hf).to(torch.bfloat16)
    for layer in model.model.layers:  # the checkpoint keeps the router bias in fp32, as Kimi's does
        if hasattr(layer.mlp, "gate") and hasattr(layer.mlp.gate, "e_score_correction_bias"):
            layer.mlp.gate.e_score_correction_bias.data = torch.randn(cfg.num_experts, dtype=torch.float32)
    return model


def saved(model: torch.nn.Module, tmp_path) -> dict[str, torch.Tensor]:
    model.save_pretrained(tmp_path)
    return load_file(tmp_path / "model.safetensors")


@pytest.fixture(scope="module")
def kimi_cfg() -> ModelConfig:
    """The composed Kimi-K2.6 model config (conf/model/kimi_k26.yaml)."""
    return OmegaConf.to_object(compose(["model=kimi_k26"])).model


CASES = [
    ("qwen3_moe", QWEN_TINY, hf_qwen),
    ("qwen3_moe_tied", dataclasses.replace(QWEN_TINY, tie_word_embeddings=True), hf_qwen),
    ("deepseek_v3", DSV3_TINY, hf_deepseek),
    (
        "deepseek_v3_no_q_lora",
        dataclasses.replace(DSV3_TINY, q_lora_rank=None, num_shared_experts=2),
        hf_deepseek,
    ),
]


@pytest.mark.parametrize(("label", "cfg", "build"), CASES, ids=[c[0] for c in CASES])
def test_hf_parameters_equal_what_save_pretrained_writes(label, cfg, build, tmp_path):
    on_disk = saved(build(cfg), tmp_path)
    specs = get_layout(cfg.family).hf_parameters(cfg)
    assert len({s.name for s in specs}) == len(specs), "duplicate names"
    assert {s.name: s.shape for s in specs} == {k: tuple(v.shape) for k, v in on_disk.items()}
    assert {s.name: s.dtype for s in specs} == {k: v.dtype for k, v in on_disk.items()}


@pytest.mark.parametrize(("label", "cfg", "build"), CASES, ids=[c[0] for c in CASES])
def test_split_experts_of_the_module_equals_the_saved_checkpoint_and_fuses_back(label, cfg, build, tmp_path):
    model = build(cfg)
    on_disk = saved(model, tmp_path)
    layout = get_layout(cfg.family)
    in_memory = dict(model.state_dict())
    in_memory = {k: v for k, v in in_memory.items() if k in set(layout.fuse_experts(on_disk, cfg))}
    split = layout.split_experts(in_memory, cfg)
    assert split.keys() == on_disk.keys()
    for name, tensor in on_disk.items():
        assert torch.equal(split[name], tensor), name
    fused = layout.fuse_experts(on_disk, cfg)
    assert fused.keys() == in_memory.keys()
    for name, tensor in in_memory.items():
        assert torch.equal(fused[name], tensor), name


def test_gate_rows_come_first_in_the_fused_gate_up_tensor():
    cfg = QWEN_TINY
    model = hf_qwen(cfg)
    layout = get_layout(cfg.family)
    gate_up = model.model.layers[1].mlp.experts.gate_up_proj
    split = layout.split_experts({"model.layers.1.mlp.experts.gate_up_proj": gate_up}, cfg)
    i = cfg.moe_intermediate_size
    assert torch.equal(split["model.layers.1.mlp.experts.3.gate_proj.weight"], gate_up[3, :i])
    assert torch.equal(split["model.layers.1.mlp.experts.3.up_proj.weight"], gate_up[3, i:])
    assert len(split) == 2 * cfg.num_experts


def test_fuse_experts_names_a_missing_expert():
    cfg = QWEN_TINY
    hf = get_layout(cfg.family).split_experts(
        {"model.layers.0.mlp.experts.down_proj": torch.zeros(4, 64, 32)}, cfg
    )
    del hf["model.layers.0.mlp.experts.2.down_proj.weight"]
    with pytest.raises(ExpertLayoutError, match=r"down_proj\[2\]"):
        get_layout(cfg.family).fuse_experts(hf, cfg)


def test_split_experts_refuses_a_fused_tensor_of_the_wrong_shape():
    with pytest.raises(ExpertLayoutError, match="moe_intermediate_size=32"):
        get_layout(QWEN_TINY.family).split_experts(
            {"model.layers.0.mlp.experts.gate_up_proj": torch.zeros(4, 48, 64)}, QWEN_TINY
        )


def test_router_and_gate_proj_have_different_roles():
    layout, cfg = get_layout(ModelFamily.qwen3_moe), QWEN_TINY
    assert layout.role("model.layers.0.mlp.gate.weight", cfg) is Role.router
    assert layout.role("model.layers.0.mlp.experts.1.gate_proj.weight", cfg) is Role.routed_expert
    assert layout.role("model.layers.0.mlp.experts.gate_up_proj", cfg) is Role.routed_expert
    assert layout.module_name("model.layers.0.mlp.gate.weight") == "model.layers.0.mlp.gate"


@pytest.mark.parametrize(
    "name",
    [
        "model.layers.2.self_attn.q_proj.weight",  # layer outside num_layers
        "model.layers.0.mlp.shared_experts.gate_proj.weight",  # qwen3_moe has none
        "model.layers.0.mlp.gate_proj.weight",
        "model.layers.x.self_attn.q_proj.weight",
        "lm_head.bias",
    ],
)
def test_unknown_qwen_names_are_refused(name):
    with pytest.raises(LayoutError, match="qwen3_moe|num_layers"):
        get_layout(ModelFamily.qwen3_moe).role(name, QWEN_TINY)


def test_deepseek_roles_follow_dense_and_moe_layers_and_q_compression():
    layout, cfg = get_layout(ModelFamily.deepseek_v3), DSV3_TINY
    assert layout.role("model.layers.0.mlp.gate_proj.weight", cfg) is Role.dense_mlp
    assert layout.role("model.layers.1.mlp.shared_experts.up_proj.weight", cfg) is Role.shared_expert
    assert layout.role("model.layers.1.mlp.gate.e_score_correction_bias", cfg) is Role.router_bias
    assert layout.role("model.layers.1.self_attn.q_a_layernorm.weight", cfg) is Role.norm
    for wrong in ("model.layers.1.mlp.gate_proj.weight", "model.layers.0.mlp.gate.weight",
                  "model.layers.0.self_attn.q_proj.weight"):  # fmt: skip
        with pytest.raises(LayoutError):
            layout.role(wrong, cfg)
    no_q_lora = dataclasses.replace(cfg, q_lora_rank=None)
    assert layout.role("model.layers.0.self_attn.q_proj.weight", no_q_lora) is Role.attention
    with pytest.raises(LayoutError):
        layout.role("model.layers.0.self_attn.q_b_proj.weight", no_q_lora)


def test_mtp_layers_follow_the_decoder_layers_and_are_all_mtp():
    cfg = dataclasses.replace(DSV3_TINY, num_nextn_predict_layers=1)
    layout = get_layout(cfg.family)
    specs = layout.hf_parameters(cfg)
    mtp = [s for s in specs if s.name.startswith("model.layers.3.")]
    assert {s.role for s in mtp} == {Role.mtp}
    names = {s.name for s in mtp}
    h = cfg.hidden_size
    assert ("model.layers.3.eh_proj.weight", (h, 2 * h)) in {(s.name, s.shape) for s in mtp}
    assert "model.layers.3.mlp.experts.3.down_proj.weight" in names
    assert "model.layers.3.shared_head.head.weight" in names
    assert layout.role("model.layers.3.self_attn.o_proj.weight", cfg) is Role.mtp
    assert not any(s.name.startswith("model.layers.3.") for s in layout.hf_parameters(DSV3_TINY))


def test_kimi_prefix_vision_tower_and_trainer_names(kimi_cfg):
    layout = get_layout(kimi_cfg.family)
    specs = {s.name: s for s in layout.hf_parameters(kimi_cfg)}
    # The public Kimi-K2.5/K2.6 checkpoint's vision shapes (hidden 1152, MLP 4304, 2x2 merge).
    assert specs["vision_tower.encoder.blocks.26.wqkv.weight"].shape == (3456, 1152)
    assert specs["vision_tower.encoder.blocks.0.mlp.fc0.weight"].shape == (4304, 1152)
    assert specs["mm_projector.proj.0.weight"].shape == (4608, 4608)
    assert specs["mm_projector.proj.2.weight"].shape == (7168, 4608)
    assert specs["language_model.model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    assert specs["language_model.model.layers.5.self_attn.kv_a_proj_with_mqa.weight"].shape == (576, 7168)
    assert specs["language_model.model.layers.5.self_attn.kv_b_proj.weight"].shape == (64 * 256, 512)
    assert specs["language_model.model.layers.5.mlp.shared_experts.down_proj.weight"].shape == (7168, 2048)
    assert layout.role("vision_tower.encoder.blocks.3.wo.weight", kimi_cfg) is Role.vision
    with pytest.raises(LayoutError, match="vision_num_layers=27"):
        layout.role("vision_tower.encoder.blocks.27.wo.weight", kimi_cfg)
    hf_name = "language_model.model.layers.4.mlp.experts.383.down_proj.weight"
    assert layout.hf_to_trainer_name(hf_name, kimi_cfg) == "model.layers.4.mlp.experts.down_proj"
    assert layout.hf_to_trainer_name("language_model.lm_head.weight", kimi_cfg) == "lm_head.weight"
    assert layout.trainer_to_hf_names("model.norm.weight", kimi_cfg) == ["language_model.model.norm.weight"]
    gate_up = layout.trainer_to_hf_names("model.layers.4.mlp.experts.gate_up_proj", kimi_cfg)
    assert len(gate_up) == 2 * 384 and gate_up[0].endswith("layers.4.mlp.experts.0.gate_proj.weight")
    assert gate_up[384] == "language_model.model.layers.4.mlp.experts.0.up_proj.weight"
    with pytest.raises(LayoutError, match="language_model"):
        layout.hf_to_trainer_name("model.norm.weight", kimi_cfg)


def test_kimi_parameter_counts_from_the_architecture(kimi_cfg):
    specs = get_layout(kimi_cfg.family).hf_parameters(kimi_cfg)
    by_role: dict[Role, int] = {}
    for s in specs:
        by_role[s.role] = by_role.get(s.role, 0) + 1
    assert by_role[Role.routed_expert] == 60 * 384 * 3
    assert by_role[Role.shared_expert] == 60 * 3
    assert by_role[Role.dense_mlp] == 1 * 3
    assert by_role[Role.attention] == 61 * 5  # q_a, q_b, kv_a_with_mqa, kv_b, o
    assert by_role[Role.router] == 60 and by_role[Role.router_bias] == 60
    assert by_role[Role.norm] == 61 * 4 + 1  # input, post_attention, q_a and kv_a layernorms; final norm
    assert by_role[Role.vision] == 3 + 27 * 12 + 2 + 6


def test_layouts_refuse_configs_they_cannot_describe():
    with pytest.raises(LayoutError, match="model.num_shared_experts=1"):
        get_layout(ModelFamily.qwen3_moe).hf_parameters(dataclasses.replace(QWEN_TINY, num_shared_experts=1))
    with pytest.raises(LayoutError, match="model.kv_lora_rank=0"):
        get_layout(ModelFamily.deepseek_v3).hf_parameters(dataclasses.replace(DSV3_TINY, kv_lora_rank=0))
    with pytest.raises(LayoutError, match="known families"):
        get_layout("llama")
