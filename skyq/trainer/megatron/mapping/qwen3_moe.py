"""Qwen3-MoE: Megatron GQA attention with qk-norm and routed experts <-> `Qwen3MoeForCausalLM` names.

Every decoder layer is an MoE layer (the qwen3_moe layout refuses dense layers and shared experts).
`linear_qkv` holds q, k and v interleaved per query group (`tables.Kind.qkv`); the local spec keeps
`input_layernorm`, the Transformer Engine spec fuses it into `linear_qkv.layer_norm_weight`. Both
keep `pre_mlp_layernorm` in an MoE layer.
"""

from __future__ import annotations

from skyq.config.schema import ModelConfig
from skyq.trainer.megatron.mapping.tables import Kind, Rule, copy, expert_rules


def layer_rules(model_cfg: ModelConfig, layer: int, spec: str | None) -> dict[str, Rule]:
    """Layer-relative Megatron name -> Rule (`spec=None`: the names of both specs)."""
    rules: dict[str, Rule] = {}
    if spec in ("local", None):
        rules["input_layernorm.weight"] = copy("input_layernorm.weight")
    if spec in ("te", None):
        rules["self_attention.linear_qkv.layer_norm_weight"] = copy("input_layernorm.weight")
    qkv = tuple(f"self_attn.{p}_proj.weight" for p in "qkv")
    rules.update(
        {
            "self_attention.linear_qkv.weight": Rule(Kind.qkv, qkv),
            "self_attention.linear_proj.weight": copy("self_attn.o_proj.weight"),
            "self_attention.q_layernorm.weight": copy("self_attn.q_norm.weight"),
            "self_attention.k_layernorm.weight": copy("self_attn.k_norm.weight"),
            "pre_mlp_layernorm.weight": copy("post_attention_layernorm.weight"),
            "mlp.router.weight": copy("mlp.gate.weight"),
        }
    )
    rules.update(expert_rules(spec))
    return rules
