"""skyq `ModelConfig` <-> HF configs: from a checkpoint's `config.json`, and to the transformers config
(and config.json) of the model the native trainer and the embedded engine build.

Converters see a checkpoint without a skyq run config; to ask the quantization plan what each
tensor is, they rebuild the model config from the HF one. Handles `qwen3_moe`, `deepseek_v3` /
`kimi_k2`, and Kimi-K2.6 style multimodal configs whose text model sits under `text_config`
(its weights under `language_model.`) next to a `vision_config` (`vt_*` or plain field names).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from skyq.config.enums import ModelFamily, RopeScaling
from skyq.config.schema import ModelConfig, RopeScalingConfig

if TYPE_CHECKING:
    from transformers import PretrainedConfig

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


YARN_KEYS = (
    "factor",
    "original_max_position_embeddings",
    "beta_fast",
    "beta_slow",
    "mscale",
    "mscale_all_dim",
)
"""`model.rope_scaling` fields, spelled as in HF `rope_parameters` / `rope_scaling`."""


def _rope_scaling(hf: dict[str, Any]) -> RopeScalingConfig:
    """YaRN from `rope_parameters` (transformers 5) or `rope_scaling` (older releases: Kimi-K2.x,
    DeepSeek-V3, with `type` for `rope_type`); plain RoPE when neither names a scaling."""
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    kind = rope.get("rope_type") or rope.get("type") or "default"
    if kind == "default":
        return RopeScalingConfig()
    if kind != RopeScaling.yarn.value:
        raise HFConfigError(
            f"config.json ({hf.get('model_type')}): rope type {kind!r} is not supported; skyq builds plain "
            "RoPE ('default') or 'yarn'"
        )
    defaults = RopeScalingConfig()
    fields = {key: _optional(rope, getattr(defaults, key), key) for key in YARN_KEYS}
    if rope.get("factor") is None:
        raise HFConfigError(f"config.json ({hf.get('model_type')}): yarn rope scaling without its factor")
    return RopeScalingConfig(
        type=RopeScaling.yarn,
        **{
            key: int(v) if key == "original_max_position_embeddings" else float(v)
            for key, v in fields.items()
        },
    )


def rope_parameters(model_cfg: ModelConfig) -> dict[str, Any]:
    """HF `rope_parameters` of `model_cfg`: what transformers 5 and vLLM read from config.json."""
    rope: dict[str, Any] = {"rope_theta": model_cfg.rope_theta, "rope_type": "default"}
    scaling = model_cfg.rope_scaling
    if RopeScaling(scaling.type) is RopeScaling.yarn:
        rope["rope_type"] = RopeScaling.yarn.value
        rope.update({key: getattr(scaling, key) for key in YARN_KEYS})
    return rope


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
        "rope_scaling": _rope_scaling(hf),
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
        "routed_scaling_factor": float(_optional(hf, 1.0, "routed_scaling_factor")),
        "n_group": int(_optional(hf, 1, "n_group")),
        "topk_group": int(_optional(hf, 1, "topk_group")),
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


VISION_HEAD_DIM = 72
"""Kimi-K2.6's vision attention head width (MoonViT: 1152 = 16 heads x 72)."""
CAUSAL_LM_ARCHITECTURE = {
    ModelFamily.qwen3_moe: "Qwen3MoeForCausalLM",
    ModelFamily.deepseek_v3: "DeepseekV3ForCausalLM",
}
"""The transformers causal-LM class (by name) the trainer and the embedded engine build per family."""
MULTIMODAL_ARCHITECTURE = "KimiK25ForConditionalGeneration"
"""config.json `architectures` of a checkpoint whose text model sits under `MULTIMODAL_TEXT_PREFIX`."""


def causal_lm_class(model_cfg: ModelConfig) -> type:
    """The transformers causal-LM class of `model_cfg`'s family."""
    import transformers

    return getattr(transformers, CAUSAL_LM_ARCHITECTURE[ModelFamily(model_cfg.family)])


def check_buildable(model_cfg: ModelConfig) -> None:
    """Refuse what a transformers causal LM of the family cannot hold, naming the key and the fix."""
    family = ModelFamily(model_cfg.family)
    problems = []
    if model_cfg.vision_num_layers:
        if family is not ModelFamily.deepseek_v3 or model_cfg.text_prefix != MULTIMODAL_TEXT_PREFIX:
            problems.append(
                f"model.vision_num_layers={model_cfg.vision_num_layers}: a vision tower is Kimi-K2.6's "
                f"(model.family=deepseek_v3, model.text_prefix={MULTIMODAL_TEXT_PREFIX}); set it to 0 for "
                f"family={family.value} text_prefix={model_cfg.text_prefix!r}"
            )
        if model_cfg.vision_hidden_size % VISION_HEAD_DIM:
            problems.append(
                f"model.vision_hidden_size={model_cfg.vision_hidden_size}: the vision tower's heads are "
                f"{VISION_HEAD_DIM} wide (MoonViT: 1152 = 16 x 72); use a multiple of {VISION_HEAD_DIM}"
            )
    if family is ModelFamily.deepseek_v3:
        if model_cfg.num_nextn_predict_layers:
            problems.append(
                f"model.num_nextn_predict_layers={model_cfg.num_nextn_predict_layers}: transformers' "
                "DeepseekV3ForCausalLM has no multi-token-prediction layers (set it to 0)"
            )
        if model_cfg.num_shared_experts < 1:
            problems.append(
                "model.num_shared_experts=0: transformers' DeepseekV3 MoE layers always hold a shared expert "
                "(set it to 1 or more)"
            )
        if model_cfg.num_key_value_heads != model_cfg.num_attention_heads:
            problems.append(
                f"model.num_key_value_heads={model_cfg.num_key_value_heads}: MLA expands one key and value per "
                f"head (set it to model.num_attention_heads={model_cfg.num_attention_heads})"
            )
        if model_cfg.num_experts % model_cfg.n_group or model_cfg.topk_group > model_cfg.n_group:
            problems.append(
                f"model.n_group={model_cfg.n_group}, model.topk_group={model_cfg.topk_group}: n_group must "
                f"divide model.num_experts={model_cfg.num_experts} and topk_group must not exceed it"
            )
    if problems:
        raise ModelBuildError(f"model={model_cfg.name}: " + "; ".join(problems))


def hf_config(model_cfg: ModelConfig) -> PretrainedConfig:
    """The transformers config of `model_cfg`: a `Qwen3MoeConfig` or a `DeepseekV3Config`.

    DeepSeek-V3 / Kimi-K2.x: MLA with one key and value per head, sigmoid routing with the fp32
    `e_score_correction_bias` (the noaux_tc top-k), top-k weights renormalized and scaled by
    `model.routed_scaling_factor`, interleaved rotary dims (the released checkpoints' layout), the
    first `model.first_k_dense_replace` layers dense. `model.rope_scaling` goes into `rope_parameters`
    (YaRN: transformers scales the rotary frequencies and cos/sin, and DeepSeek-V3's softmax scale).
    """
    check_buildable(model_cfg)
    common = {
        "vocab_size": model_cfg.vocab_size,
        "hidden_size": model_cfg.hidden_size,
        "num_hidden_layers": model_cfg.num_layers,
        "num_attention_heads": model_cfg.num_attention_heads,
        "intermediate_size": model_cfg.intermediate_size,
        "moe_intermediate_size": model_cfg.moe_intermediate_size,
        "num_experts_per_tok": model_cfg.num_experts_per_tok,
        # Qwen3-MoE, DeepSeek-V3 and Kimi-K2.x releases renormalize the top-k routing weights.
        "norm_topk_prob": True,
        "max_position_embeddings": model_cfg.max_position_embeddings,
        "rope_parameters": rope_parameters(model_cfg),
        "rms_norm_eps": model_cfg.rms_norm_eps,
        "tie_word_embeddings": model_cfg.tie_word_embeddings,
        "attn_implementation": "sdpa",
    }
    if ModelFamily(model_cfg.family) is ModelFamily.deepseek_v3:
        from transformers import DeepseekV3Config  # lazily: the converters import this module too

        return DeepseekV3Config(
            **common,
            num_key_value_heads=model_cfg.num_attention_heads,
            n_routed_experts=model_cfg.num_experts,
            n_shared_experts=model_cfg.num_shared_experts,
            first_k_dense_replace=model_cfg.first_k_dense_replace,
            q_lora_rank=model_cfg.q_lora_rank,
            kv_lora_rank=model_cfg.kv_lora_rank,
            qk_nope_head_dim=model_cfg.qk_nope_head_dim,
            qk_rope_head_dim=model_cfg.qk_rope_head_dim,
            v_head_dim=model_cfg.v_head_dim,
            routed_scaling_factor=model_cfg.routed_scaling_factor,
            n_group=model_cfg.n_group,
            topk_group=model_cfg.topk_group,
            rope_interleave=True,
            num_mtp_layers=0,
        )
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        **common,
        num_key_value_heads=model_cfg.num_key_value_heads,
        head_dim=model_cfg.head_dim,
        num_experts=model_cfg.num_experts,
    )


def checkpoint_config_json(model_cfg: ModelConfig) -> dict[str, Any]:
    """The config.json of a bf16 checkpoint skyq writes for `model_cfg`: the causal LM's config,
    nested under `text_config` of a `KimiK25ForConditionalGeneration` config when the text weights
    carry `MULTIMODAL_TEXT_PREFIX` (so `model_config_from_hf` gives `model_cfg` back)."""
    text = hf_config(model_cfg).to_dict()
    text["architectures"] = [CAUSAL_LM_ARCHITECTURE[ModelFamily(model_cfg.family)]]
    text["dtype"] = "bfloat16"
    if ModelFamily(model_cfg.family) is ModelFamily.deepseek_v3:
        text["scoring_func"], text["topk_method"] = "sigmoid", "noaux_tc"
        text["num_nextn_predict_layers"] = model_cfg.num_nextn_predict_layers
    if not model_cfg.text_prefix:
        return text
    if model_cfg.text_prefix != MULTIMODAL_TEXT_PREFIX:
        raise ModelBuildError(
            f"model.text_prefix={model_cfg.text_prefix!r}: a checkpoint's text weights sit under "
            f"{MULTIMODAL_TEXT_PREFIX!r} (Kimi-K2.6) or under no prefix"
        )
    config = {
        "architectures": [MULTIMODAL_ARCHITECTURE],
        "model_type": "kimi_k25",
        "dtype": "bfloat16",
        "text_config": text,
    }
    if model_cfg.vision_num_layers:
        config["vision_config"] = {
            "model_type": "kimi_k25_vision",
            "num_hidden_layers": model_cfg.vision_num_layers,
            "hidden_size": model_cfg.vision_hidden_size,
            "intermediate_size": model_cfg.vision_intermediate_size,
            "num_attention_heads": model_cfg.vision_hidden_size // VISION_HEAD_DIM,
            "patch_size": 14,
            "merge_kernel_size": [2, 2],
        }
    return config


ARCHITECTURE_KEYS = (
    "family", "vocab_size", "hidden_size", "num_layers", "num_attention_heads", "num_key_value_heads",
    "moe_intermediate_size", "num_experts", "num_experts_per_tok", "tie_word_embeddings", "text_prefix",
    "rope_scaling",
)  # fmt: skip
"""`ModelConfig` keys a checkpoint's config.json must agree on to be loaded into the model (the rotary
scaling too: the weights load under any, but compute a different function)."""
FAMILY_ARCHITECTURE_KEYS = {
    ModelFamily.qwen3_moe: ("head_dim",),
    ModelFamily.deepseek_v3: (
        "intermediate_size", "num_shared_experts", "first_k_dense_replace", "q_lora_rank", "kv_lora_rank",
        "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "routed_scaling_factor", "n_group", "topk_group",
        "vision_num_layers",
    ),
}  # fmt: skip


def architecture_mismatches(hf: dict[str, Any], model_cfg: ModelConfig) -> list[str]:
    """`key: checkpoint X != model config Y` for each architecture key on which the parsed config.json
    `hf` disagrees with `model_cfg` (the routing rule too: renormalized top-k, DeepSeek's sigmoid)."""
    on_disk = model_config_from_hf(hf)
    keys = ARCHITECTURE_KEYS + FAMILY_ARCHITECTURE_KEYS[ModelFamily(model_cfg.family)]
    wrong = [
        f"model.{key}: checkpoint {getattr(on_disk, key)!r} != model config {getattr(model_cfg, key)!r}"
        for key in keys
        if getattr(on_disk, key) != getattr(model_cfg, key)
    ]
    text = text_config_of(hf)
    fixed: dict[str, Any] = {"norm_topk_prob": True}
    if on_disk.family is ModelFamily.deepseek_v3:
        fixed["scoring_func"] = "sigmoid"
    wrong += [
        f"{key}: checkpoint {text[key]!r}, skyq builds {value!r}"
        for key, value in fixed.items()
        if key in text and text[key] != value
    ]
    return wrong
