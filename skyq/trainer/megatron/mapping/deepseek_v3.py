"""DeepSeek-V3 / Kimi-K2.x: Megatron MLA attention, dense and MoE layers <-> `DeepseekV3ForCausalLM` names.

Attention (every layer): `linear_q_proj` (no q compression) or `linear_q_down_proj` + q norm +
`linear_q_up_proj`; `linear_kv_down_proj` (kv_lora rows then the rope rows, as HF's
`kv_a_proj_with_mqa`) + kv norm + `linear_kv_up_proj` (per head: nope rows then v rows, as HF's
`kv_b_proj`); `linear_proj`. The local spec keeps the q and kv norms as `q_layernorm` /
`kv_layernorm`; the Transformer Engine spec fuses them into `linear_q_up_proj.layer_norm_weight` /
`linear_kv_up_proj.layer_norm_weight`. Layers below `first_k_dense_replace` have a dense gated MLP
(the TE spec fuses its norm into `mlp.linear_fc1.layer_norm_weight`), the others the sigmoid router
with its fp32 `expert_bias` buffer (HF `e_score_correction_bias`), routed experts and the shared
experts (`mlp.shared_experts.linear_fc{1,2}`, width moe_intermediate_size * num_shared_experts).
"""

from __future__ import annotations

from skyq.config.schema import ModelConfig
from skyq.trainer.megatron.mapping.tables import Rule, copy, expert_rules, gate_up


def _attention(model_cfg: ModelConfig, spec: str | None) -> dict[str, Rule]:
    a = "self_attention."
    rules: dict[str, Rule] = {"input_layernorm.weight": copy("input_layernorm.weight")}
    if model_cfg.q_lora_rank is None:
        rules[a + "linear_q_proj.weight"] = copy("self_attn.q_proj.weight")
    else:
        rules[a + "linear_q_down_proj.weight"] = copy("self_attn.q_a_proj.weight")
        if spec in ("local", None):
            rules[a + "q_layernorm.weight"] = copy("self_attn.q_a_layernorm.weight")
        if spec in ("te", None):
            rules[a + "linear_q_up_proj.layer_norm_weight"] = copy("self_attn.q_a_layernorm.weight")
        rules[a + "linear_q_up_proj.weight"] = copy("self_attn.q_b_proj.weight")
    rules[a + "linear_kv_down_proj.weight"] = copy("self_attn.kv_a_proj_with_mqa.weight")
    if spec in ("local", None):
        rules[a + "kv_layernorm.weight"] = copy("self_attn.kv_a_layernorm.weight")
    if spec in ("te", None):
        rules[a + "linear_kv_up_proj.layer_norm_weight"] = copy("self_attn.kv_a_layernorm.weight")
    rules[a + "linear_kv_up_proj.weight"] = copy("self_attn.kv_b_proj.weight")
    rules[a + "linear_proj.weight"] = copy("self_attn.o_proj.weight")
    return rules


def _dense_mlp(spec: str | None) -> dict[str, Rule]:
    rules: dict[str, Rule] = {}
    if spec in ("local", None):
        rules["pre_mlp_layernorm.weight"] = copy("post_attention_layernorm.weight")
    if spec in ("te", None):
        rules["mlp.linear_fc1.layer_norm_weight"] = copy("post_attention_layernorm.weight")
    rules["mlp.linear_fc1.weight"] = gate_up("mlp")
    rules["mlp.linear_fc2.weight"] = copy("mlp.down_proj.weight")
    return rules


def _moe(model_cfg: ModelConfig, spec: str | None) -> dict[str, Rule]:
    rules = {
        "pre_mlp_layernorm.weight": copy("post_attention_layernorm.weight"),
        "mlp.router.weight": copy("mlp.gate.weight"),
        "mlp.router.expert_bias": copy("mlp.gate.e_score_correction_bias"),
    }
    if model_cfg.num_shared_experts:
        rules["mlp.shared_experts.linear_fc1.weight"] = gate_up("mlp.shared_experts")
        rules["mlp.shared_experts.linear_fc2.weight"] = copy("mlp.shared_experts.down_proj.weight")
    rules.update(expert_rules(spec))
    return rules


def layer_rules(model_cfg: ModelConfig, layer: int, spec: str | None) -> dict[str, Rule]:
    """Layer-relative Megatron name -> Rule (`spec=None`: the names of both specs)."""
    dense = layer < model_cfg.first_k_dense_replace
    return {**_attention(model_cfg, spec), **(_dense_mlp(spec) if dense else _moe(model_cfg, spec))}
