"""A skyq `ModelConfig` derived from a checkpoint's `config.json` (for converters and inspect).

Converters see a checkpoint without a skyq run config; to ask the quantization plan what each
tensor is, they rebuild the model config from the HF one. Handles `qwen3_moe`, `deepseek_v3` /
`kimi_k2`, and Kimi-K2.6 style multimodal configs whose text model sits under `text_config`
(its weights under `language_model.`) next to a `vision_config` (`vt_*` or plain field names).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from skyq.config.enums import ModelFamily
from skyq.config.schema import ModelConfig

if TYPE_CHECKING:
    from transformers import Qwen3MoeConfig

FAMILY_OF_MODEL_TYPE = {
    "qwen3_moe": ModelFamily.qwen3_moe,
    "deepseek_v3": ModelFamily.deepseek_v3,
    "kimi_k2": ModelFamily.deepseek_v3,
}
MULTIMODAL_TEXT_PREFIX = "language_model."


class HFConfigError(ValueError):
    """config.json lacks a field the model family needs, or names an unsupported model type."""


def _required(hf: dict[str, Any], *keys: str) -> Any:
    """The first of `keys` present in `hf` (HF renamed some fields across versions)."""
    for key in keys:
        if hf.get(key) is not None:
            return hf[key]
    raise HFConfigError(f"config.json ({hf.get('model_type')}): missing {' or '.join(keys)}")


def _optional(hf: dict[str, Any], fallback: Any, *keys: str) -> Any:
    for key in keys:
        if hf.get(key) is not None:
            return hf[key]
    return fallback


def _rope_theta(hf: dict[str, Any], fallback: float) -> float:
    # transformers 5 moved rope_theta into rope_parameters.
    rope = hf.get("rope_parameters")
    if isinstance(rope, dict) and rope.get("rope_theta") is not None:
        return float(rope["rope_theta"])
    return float(_optional(hf, fallback, "rope_theta"))


def _common(hf: dict[str, Any], defaults: ModelConfig) -> dict[str, Any]:
    heads = int(_required(hf, "num_attention_heads"))
    hidden = int(_required(hf, "hidden_size"))
    return {
        "vocab_size": int(_required(hf, "vocab_size")),
        "hidden_size": hidden,
        "num_layers": int(_required(hf, "num_hidden_layers")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_optional(hf, heads, "num_key_value_heads")),
        "head_dim": int(_optional(hf, hidden // heads, "head_dim")),
        "intermediate_size": int(_required(hf, "intermediate_size")),
        "moe_intermediate_size": int(_required(hf, "moe_intermediate_size")),
        "num_experts_per_tok": int(_required(hf, "num_experts_per_tok")),
        "max_position_embeddings": int(
            _optional(hf, defaults.max_position_embeddings, "max_position_embeddings")
        ),
        "rope_theta": _rope_theta(hf, defaults.rope_theta),
        "rms_norm_eps": float(_optional(hf, defaults.rms_norm_eps, "rms_norm_eps")),
        "tie_word_embeddings": bool(_optional(hf, False, "tie_word_embeddings")),
    }


def _deepseek_fields(hf: dict[str, Any]) -> dict[str, Any]:
    return {
        "num_experts": int(_required(hf, "n_routed_experts")),
        "num_shared_experts": int(_optional(hf, 0, "n_shared_experts")),
        "first_k_dense_replace": int(_optional(hf, 0, "first_k_dense_replace")),
        "q_lora_rank": hf.get("q_lora_rank"),
        "kv_lora_rank": int(_required(hf, "kv_lora_rank")),
        "qk_nope_head_dim": int(_required(hf, "qk_nope_head_dim")),
        "qk_rope_head_dim": int(_required(hf, "qk_rope_head_dim")),
        "v_head_dim": int(_required(hf, "v_head_dim")),
        "num_nextn_predict_layers": int(_optional(hf, 0, "num_nextn_predict_layers")),
    }


def _vision_fields(vision: dict[str, Any]) -> dict[str, Any]:
    # Kimi-K2.5/2.6 releases spell these vt_*; re-saved configs use the plain names.
    return {
        "vision_num_layers": int(_required(vision, "vt_num_hidden_layers", "num_hidden_layers")),
        "vision_hidden_size": int(_required(vision, "vt_hidden_size", "hidden_size")),
        "vision_intermediate_size": int(_required(vision, "vt_intermediate_size", "intermediate_size")),
    }


def text_config_of(hf: dict[str, Any]) -> dict[str, Any]:
    """The text model's config: `text_config` of a multimodal config, else the config itself."""
    text = hf.get("text_config")
    return text if isinstance(text, dict) else hf


def model_config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """The skyq `ModelConfig` describing the checkpoint whose parsed config.json is `hf`."""
    text = text_config_of(hf)
    model_type = text.get("model_type")
    if model_type not in FAMILY_OF_MODEL_TYPE:
        raise HFConfigError(
            f"config.json: model_type {model_type!r} is not supported; skyq knows "
            f"{sorted(FAMILY_OF_MODEL_TYPE)} (a multimodal config must carry one of them in text_config)"
        )
    family = FAMILY_OF_MODEL_TYPE[model_type]
    defaults = ModelConfig()
    fields = {"name": str(hf.get("model_type", model_type)), "family": family, **_common(text, defaults)}
    if family is ModelFamily.deepseek_v3:
        fields.update(_deepseek_fields(text))
    else:
        fields["num_experts"] = int(_required(text, "num_experts", "num_local_experts"))
    if text is not hf:
        fields["text_prefix"] = MULTIMODAL_TEXT_PREFIX
        if isinstance(hf.get("vision_config"), dict):
            fields.update(_vision_fields(hf["vision_config"]))
    return ModelConfig(**fields)


class ModelBuildError(ValueError):
    """A model config the native backend cannot build, or a checkpoint that does not match it."""


def hf_config(model_cfg: ModelConfig) -> Qwen3MoeConfig:
    """The transformers config of `model_cfg` (qwen3_moe family only)."""
    from transformers import Qwen3MoeConfig  # lazily: the converters import this module too

    if ModelFamily(model_cfg.family) is not ModelFamily.qwen3_moe:
        raise ModelBuildError(
            f"model.family={model_cfg.family.value}: the native trainer builds qwen3_moe models only; "
            "use trainer=megatron for deepseek_v3"
        )
    return Qwen3MoeConfig(
        vocab_size=model_cfg.vocab_size,
        hidden_size=model_cfg.hidden_size,
        num_hidden_layers=model_cfg.num_layers,
        num_attention_heads=model_cfg.num_attention_heads,
        num_key_value_heads=model_cfg.num_key_value_heads,
        head_dim=model_cfg.head_dim,
        intermediate_size=model_cfg.intermediate_size,
        moe_intermediate_size=model_cfg.moe_intermediate_size,
        num_experts=model_cfg.num_experts,
        num_experts_per_tok=model_cfg.num_experts_per_tok,
        # Qwen3-MoE releases renormalize the top-k routing weights.
        norm_topk_prob=True,
        max_position_embeddings=model_cfg.max_position_embeddings,
        rope_parameters={"rope_theta": model_cfg.rope_theta, "rope_type": "default"},
        rms_norm_eps=model_cfg.rms_norm_eps,
        tie_word_embeddings=model_cfg.tie_word_embeddings,
        attn_implementation="sdpa",
    )
