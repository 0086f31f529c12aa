"""Qwen3-MoE (`Qwen3MoeForCausalLM`; Qwen3-30B-A3B and the tiny_moe test model).

Per layer L: GQA attention `self_attn.{q,k,v,o}_proj` with per-head `q_norm`/`k_norm`, the router
`mlp.gate` (an nn.Linear (E, H) — never quantized, and a pattern for it must not catch `gate_proj`),
routed experts `mlp.experts.{e}.{gate,up,down}_proj`, and two RMSNorms. No shared experts, no dense
layers, no MTP: a config asking for them is refused rather than silently ignored.
"""

from __future__ import annotations

from skyq.config.enums import ModelFamily
from skyq.config.schema import ModelConfig
from skyq.quant.layouts.base import (
    LayoutError,
    ModelQuantizationLayout,
    ParamSpec,
    Role,
    hf_dtype_name,
    require_positive,
)

_LAYER = "model.layers."

# Layer-relative names (expert index written as `*`) and their roles.
_LAYER_ROLES: dict[str, Role] = {
    "self_attn.q_proj.weight": Role.attention,
    "self_attn.k_proj.weight": Role.attention,
    "self_attn.v_proj.weight": Role.attention,
    "self_attn.o_proj.weight": Role.attention,
    "self_attn.q_norm.weight": Role.norm,
    "self_attn.k_norm.weight": Role.norm,
    "input_layernorm.weight": Role.norm,
    "post_attention_layernorm.weight": Role.norm,
    "mlp.gate.weight": Role.router,
    "mlp.experts.*.gate_proj.weight": Role.routed_expert,
    "mlp.experts.*.up_proj.weight": Role.routed_expert,
    "mlp.experts.*.down_proj.weight": Role.routed_expert,
    "mlp.experts.gate_up_proj": Role.routed_expert,
    "mlp.experts.down_proj": Role.routed_expert,
}


def split_layer_name(body: str) -> tuple[int, str] | None:
    """`model.layers.7.mlp.experts.3.up_proj.weight` -> (7, `mlp.experts.*.up_proj.weight`)."""
    if not body.startswith(_LAYER):
        return None
    index, _, rest = body[len(_LAYER) :].partition(".")
    if not index.isdigit() or not rest:
        return None
    if rest.startswith("mlp.experts."):
        parts = rest.split(".")
        if len(parts) == 5 and parts[2].isdigit():
            rest = f"mlp.experts.*.{parts[3]}.{parts[4]}"
    return int(index), rest


def routed_expert_specs(layer: str, model_cfg: ModelConfig) -> list[ParamSpec]:
    """The per-expert HF tensors of one MoE layer, expert-major (as `save_pretrained` groups them)."""
    e_count, h, i = model_cfg.num_experts, model_cfg.hidden_size, model_cfg.moe_intermediate_size
    dtype = hf_dtype_name(Role.routed_expert)
    specs = []
    for e in range(e_count):
        base = f"{layer}mlp.experts.{e}."
        specs.append(ParamSpec(base + "gate_proj.weight", (i, h), Role.routed_expert, dtype))
        specs.append(ParamSpec(base + "up_proj.weight", (i, h), Role.routed_expert, dtype))
        specs.append(ParamSpec(base + "down_proj.weight", (h, i), Role.routed_expert, dtype))
    return specs


class Qwen3MoeLayout(ModelQuantizationLayout):
    family = ModelFamily.qwen3_moe

    def _check(self, model_cfg: ModelConfig) -> None:
        require_positive(
            model_cfg, "vocab_size", "hidden_size", "num_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "moe_intermediate_size", "num_experts",
        )  # fmt: skip
        unsupported = {
            "num_shared_experts": model_cfg.num_shared_experts,
            "first_k_dense_replace": model_cfg.first_k_dense_replace,
            "num_nextn_predict_layers": model_cfg.num_nextn_predict_layers,
            "vision_num_layers": model_cfg.vision_num_layers,
        }
        for key, value in unsupported.items():
            if value != 0:
                raise LayoutError(
                    f"model.{key}={value}: the qwen3_moe layout has no such part; set it to 0 "
                    f"or use model.family=deepseek_v3"
                )

    def hf_parameters(self, model_cfg: ModelConfig) -> list[ParamSpec]:
        self._check(model_cfg)
        h, hd = model_cfg.hidden_size, model_cfg.head_dim
        q_out, kv_out = model_cfg.num_attention_heads * hd, model_cfg.num_key_value_heads * hd
        p = model_cfg.text_prefix
        bf16 = hf_dtype_name(Role.attention)
        specs = [ParamSpec(f"{p}model.embed_tokens.weight", (model_cfg.vocab_size, h), Role.embedding, bf16)]
        for layer_index in range(model_cfg.num_layers):
            layer = f"{p}{_LAYER}{layer_index}."
            specs += [
                ParamSpec(layer + "input_layernorm.weight", (h,), Role.norm, bf16),
                ParamSpec(layer + "self_attn.q_proj.weight", (q_out, h), Role.attention, bf16),
                ParamSpec(layer + "self_attn.k_proj.weight", (kv_out, h), Role.attention, bf16),
                ParamSpec(layer + "self_attn.v_proj.weight", (kv_out, h), Role.attention, bf16),
                ParamSpec(layer + "self_attn.o_proj.weight", (h, q_out), Role.attention, bf16),
                ParamSpec(layer + "self_attn.q_norm.weight", (hd,), Role.norm, bf16),
                ParamSpec(layer + "self_attn.k_norm.weight", (hd,), Role.norm, bf16),
                ParamSpec(layer + "post_attention_layernorm.weight", (h,), Role.norm, bf16),
                ParamSpec(layer + "mlp.gate.weight", (model_cfg.num_experts, h), Role.router, bf16),
            ]
            specs += routed_expert_specs(layer, model_cfg)
        specs.append(ParamSpec(f"{p}model.norm.weight", (h,), Role.norm, bf16))
        if not model_cfg.tie_word_embeddings:
            specs.append(ParamSpec(f"{p}lm_head.weight", (model_cfg.vocab_size, h), Role.lm_head, bf16))
        return specs

    def _text_role(self, body: str, model_cfg: ModelConfig) -> Role:
        top = self._top_role(body, model_cfg)
        if top is not None:
            return top
        parsed = split_layer_name(body)
        if parsed is not None:
            index, rest = parsed
            role = _LAYER_ROLES.get(rest)
            if role is not None and index < model_cfg.num_layers:
                return role
            if role is not None:
                raise LayoutError(f"{body}: layer {index} is outside model.num_layers={model_cfg.num_layers}")
        raise LayoutError(f"{body}: not a parameter of the qwen3_moe layout")
