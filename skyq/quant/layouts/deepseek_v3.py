"""DeepSeek-V3 architecture (`DeepseekV3ForCausalLM`): Kimi-K2.x, including Kimi-K2.6's multimodal release.

Per layer L: MLA attention — `q_a_proj` + `q_a_layernorm` + `q_b_proj` (or one `q_proj` when
`q_lora_rank` is None), `kv_a_proj_with_mqa` (kv_lora + rope rows) + `kv_a_layernorm`, `kv_b_proj`,
`o_proj`; layers L < first_k_dense_replace have a dense MLP `mlp.{gate,up,down}_proj`, the others
the router `mlp.gate.weight` + fp32 `mlp.gate.e_score_correction_bias`, routed experts and
`mlp.shared_experts.*` (width moe_intermediate_size * num_shared_experts, as in transformers and the
DeepSeek-V3 / Kimi checkpoints). MTP layers are `model.layers.{num_layers + i}.*`: a full MoE decoder
layer plus `embed_tokens`, `enorm`, `hnorm`, `eh_proj`, `shared_head.{norm,head}` — all role `mtp`.

Kimi-K2.6 (`KimiK25ForConditionalGeneration`) puts the text model under `text_prefix`
(`language_model.`) and adds the MoonViT vision tower and the patch-merger projector, named as in
the public K2.5/K2.6 checkpoint: `vision_tower.patch_embed.{proj,pos_emb}`,
`vision_tower.encoder.blocks.{i}.{norm0,wqkv,wo,norm1,mlp.fc0,mlp.fc1}`,
`vision_tower.encoder.final_layernorm`, `mm_projector.{pre_norm,proj.0,proj.2}`.
"""

from __future__ import annotations

from skyq.config.enums import ModelFamily
from skyq.config.schema import ModelConfig
from skyq.quant.layouts import vision
from skyq.quant.layouts.base import (
    LayoutError,
    ModelQuantizationLayout,
    ParamSpec,
    Role,
    hf_dtype_name,
    require_positive,
)
from skyq.quant.layouts.qwen3_moe import routed_expert_specs, split_layer_name

_LAYER = "model.layers."

_ATTENTION_ROLES: dict[str, Role] = {
    "self_attn.q_a_proj.weight": Role.attention,
    "self_attn.q_b_proj.weight": Role.attention,
    "self_attn.q_proj.weight": Role.attention,
    "self_attn.kv_a_proj_with_mqa.weight": Role.attention,
    "self_attn.kv_b_proj.weight": Role.attention,
    "self_attn.o_proj.weight": Role.attention,
    "self_attn.q_a_layernorm.weight": Role.norm,
    "self_attn.kv_a_layernorm.weight": Role.norm,
    "input_layernorm.weight": Role.norm,
    "post_attention_layernorm.weight": Role.norm,
}
_DENSE_ROLES: dict[str, Role] = {
    "mlp.gate_proj.weight": Role.dense_mlp,
    "mlp.up_proj.weight": Role.dense_mlp,
    "mlp.down_proj.weight": Role.dense_mlp,
}
_MOE_ROLES: dict[str, Role] = {
    "mlp.gate.weight": Role.router,
    "mlp.gate.e_score_correction_bias": Role.router_bias,
    "mlp.experts.*.gate_proj.weight": Role.routed_expert,
    "mlp.experts.*.up_proj.weight": Role.routed_expert,
    "mlp.experts.*.down_proj.weight": Role.routed_expert,
    "mlp.experts.gate_up_proj": Role.routed_expert,
    "mlp.experts.down_proj": Role.routed_expert,
    "mlp.shared_experts.gate_proj.weight": Role.shared_expert,
    "mlp.shared_experts.up_proj.weight": Role.shared_expert,
    "mlp.shared_experts.down_proj.weight": Role.shared_expert,
}
_MTP_ONLY = ("embed_tokens.weight", "enorm.weight", "hnorm.weight", "eh_proj.weight")
_MTP_ONLY += ("shared_head.norm.weight", "shared_head.head.weight")


def _spec(name: str, shape: tuple[int, ...], role: Role) -> ParamSpec:
    return ParamSpec(name, shape, role, hf_dtype_name(role))


class DeepseekV3Layout(ModelQuantizationLayout):
    family = ModelFamily.deepseek_v3

    def _check(self, model_cfg: ModelConfig) -> None:
        require_positive(
            model_cfg, "vocab_size", "hidden_size", "num_layers", "num_attention_heads", "intermediate_size",
            "moe_intermediate_size", "num_experts", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
            "v_head_dim",
        )  # fmt: skip
        if model_cfg.q_lora_rank is not None:
            require_positive(model_cfg, "q_lora_rank")
        if not 0 <= model_cfg.first_k_dense_replace <= model_cfg.num_layers:
            raise LayoutError(
                f"model.first_k_dense_replace={model_cfg.first_k_dense_replace} must lie in "
                f"[0, model.num_layers={model_cfg.num_layers}]"
            )
        for key in ("num_shared_experts", "num_nextn_predict_layers", "vision_num_layers"):
            if getattr(model_cfg, key) < 0:
                raise LayoutError(f"model.{key}={getattr(model_cfg, key)} must be >= 0")
        if model_cfg.vision_num_layers:
            require_positive(model_cfg, "vision_hidden_size", "vision_intermediate_size")

    def _attention(self, layer: str, model_cfg: ModelConfig) -> list[ParamSpec]:
        h, heads = model_cfg.hidden_size, model_cfg.num_attention_heads
        qk_head = model_cfg.qk_nope_head_dim + model_cfg.qk_rope_head_dim
        kv_lora, a = model_cfg.kv_lora_rank, layer + "self_attn."
        specs = [_spec(layer + "input_layernorm.weight", (h,), Role.norm)]
        if model_cfg.q_lora_rank is None:
            specs.append(_spec(a + "q_proj.weight", (heads * qk_head, h), Role.attention))
        else:
            q_lora = model_cfg.q_lora_rank
            specs += [
                _spec(a + "q_a_proj.weight", (q_lora, h), Role.attention),
                _spec(a + "q_a_layernorm.weight", (q_lora,), Role.norm),
                _spec(a + "q_b_proj.weight", (heads * qk_head, q_lora), Role.attention),
            ]
        specs += [
            _spec(a + "kv_a_proj_with_mqa.weight", (kv_lora + model_cfg.qk_rope_head_dim, h), Role.attention),
            _spec(a + "kv_a_layernorm.weight", (kv_lora,), Role.norm),
            _spec(a + "kv_b_proj.weight", (heads * (model_cfg.qk_nope_head_dim + model_cfg.v_head_dim), kv_lora), Role.attention),
            _spec(a + "o_proj.weight", (h, heads * model_cfg.v_head_dim), Role.attention),
            _spec(layer + "post_attention_layernorm.weight", (h,), Role.norm),
        ]  # fmt: skip
        return specs

    def _mlp(self, layer: str, dense: bool, model_cfg: ModelConfig) -> list[ParamSpec]:
        h, m = model_cfg.hidden_size, layer + "mlp."
        if dense:
            i = model_cfg.intermediate_size
            return [
                _spec(m + "gate_proj.weight", (i, h), Role.dense_mlp),
                _spec(m + "up_proj.weight", (i, h), Role.dense_mlp),
                _spec(m + "down_proj.weight", (h, i), Role.dense_mlp),
            ]
        e = model_cfg.num_experts
        specs = [
            _spec(m + "gate.weight", (e, h), Role.router),
            _spec(m + "gate.e_score_correction_bias", (e,), Role.router_bias),
        ]
        specs += routed_expert_specs(layer, model_cfg)
        if model_cfg.num_shared_experts:
            s = model_cfg.moe_intermediate_size * model_cfg.num_shared_experts
            specs += [
                _spec(m + "shared_experts.gate_proj.weight", (s, h), Role.shared_expert),
                _spec(m + "shared_experts.up_proj.weight", (s, h), Role.shared_expert),
                _spec(m + "shared_experts.down_proj.weight", (h, s), Role.shared_expert),
            ]
        return specs

    def _mtp(self, layer: str, model_cfg: ModelConfig) -> list[ParamSpec]:
        h, v = model_cfg.hidden_size, model_cfg.vocab_size
        decoder = self._attention(layer, model_cfg) + self._mlp(layer, False, model_cfg)
        extra = [
            _spec(layer + "embed_tokens.weight", (v, h), Role.mtp),
            _spec(layer + "enorm.weight", (h,), Role.mtp),
            _spec(layer + "hnorm.weight", (h,), Role.mtp),
            _spec(layer + "eh_proj.weight", (h, 2 * h), Role.mtp),
            _spec(layer + "shared_head.norm.weight", (h,), Role.mtp),
            _spec(layer + "shared_head.head.weight", (v, h), Role.mtp),
        ]
        return extra + [ParamSpec(s.name, s.shape, Role.mtp, s.dtype_name) for s in decoder]

    def hf_parameters(self, model_cfg: ModelConfig) -> list[ParamSpec]:
        self._check(model_cfg)
        p, h, v = model_cfg.text_prefix, model_cfg.hidden_size, model_cfg.vocab_size
        specs = [_spec(f"{p}model.embed_tokens.weight", (v, h), Role.embedding)]
        for index in range(model_cfg.num_layers):
            layer = f"{p}{_LAYER}{index}."
            specs += self._attention(layer, model_cfg)
            specs += self._mlp(layer, index < model_cfg.first_k_dense_replace, model_cfg)
        for index in range(model_cfg.num_layers, model_cfg.num_layers + model_cfg.num_nextn_predict_layers):
            specs += self._mtp(f"{p}{_LAYER}{index}.", model_cfg)
        specs.append(_spec(f"{p}model.norm.weight", (h,), Role.norm))
        if not model_cfg.tie_word_embeddings:
            specs.append(_spec(f"{p}lm_head.weight", (v, h), Role.lm_head))
        if model_cfg.vision_num_layers:
            specs += [_spec(name, shape, Role.vision) for name, shape in vision.vision_parameters(model_cfg)]
        return specs

    def _other_role(self, name: str, model_cfg: ModelConfig) -> Role | None:
        if not vision.is_vision_name(name):
            return None
        if name not in vision.vision_names(model_cfg):
            raise LayoutError(
                f"{name}: not a vision-tower/projector tensor of this model config "
                f"(model.vision_num_layers={model_cfg.vision_num_layers})"
            )
        return Role.vision

    def _text_role(self, body: str, model_cfg: ModelConfig) -> Role:
        top = self._top_role(body, model_cfg)
        if top is not None:
            return top
        parsed = split_layer_name(body)
        if parsed is not None:
            index, rest = parsed
            dense = index < model_cfg.first_k_dense_replace
            mtp = model_cfg.num_layers <= index < model_cfg.num_layers + model_cfg.num_nextn_predict_layers
            role = _ATTENTION_ROLES.get(rest) or (_DENSE_ROLES if dense else _MOE_ROLES).get(rest)
            if mtp and (role is not None or rest in _MTP_ONLY):
                return Role.mtp
            if (
                role is not None
                and index < model_cfg.num_layers
                and self._has_attention_param(rest, model_cfg)
            ):
                return role
        raise LayoutError(f"{body}: not a parameter of the deepseek_v3 layout for this model config")

    def _has_attention_param(self, rest: str, model_cfg: ModelConfig) -> bool:
        """q_proj exists only without q compression; q_a/q_b projections only with it."""
        if rest == "self_attn.q_proj.weight":
            return model_cfg.q_lora_rank is None
        if rest.startswith(("self_attn.q_a_", "self_attn.q_b_")):
            return model_cfg.q_lora_rank is not None
        if rest.startswith("mlp.shared_experts."):
            return model_cfg.num_shared_experts > 0
        return True
