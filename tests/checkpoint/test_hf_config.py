"""model_config_from_hf: Qwen3-MoE (transformers 5 names), DeepSeek-V3/Kimi-K2, nested K2.6 text_config."""

from __future__ import annotations

import pytest

from skyq.checkpoint.hf_config import HFConfigError, model_config_from_hf
from skyq.config.enums import ModelFamily

QWEN = {
    "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048, "num_hidden_layers": 48,
    "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 6144,
    "moe_intermediate_size": 768, "num_local_experts": 128, "num_experts_per_tok": 8,
    "rope_parameters": {"rope_theta": 1e6, "rope_type": "default"}, "rms_norm_eps": 1e-6,
}  # fmt: skip
KIMI_TEXT = {
    "model_type": "kimi_k2", "vocab_size": 163840, "hidden_size": 7168, "num_hidden_layers": 61,
    "num_attention_heads": 64, "intermediate_size": 18432, "moe_intermediate_size": 2048, "n_routed_experts": 384,
    "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 1, "q_lora_rank": 1536,
    "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "rope_theta": 50000.0,
}  # fmt: skip


def test_qwen3_moe_with_transformers5_field_names():
    cfg = model_config_from_hf(QWEN)
    assert cfg.family is ModelFamily.qwen3_moe and cfg.num_experts == 128 and cfg.rope_theta == 1e6
    assert (cfg.moe_intermediate_size, cfg.num_key_value_heads, cfg.text_prefix) == (768, 4, "")


def test_kimi_k26_nested_text_config_and_vt_vision_fields():
    hf = {"model_type": "kimi_k25", "text_config": KIMI_TEXT,
          "vision_config": {"vt_num_hidden_layers": 27, "vt_hidden_size": 1152, "vt_intermediate_size": 4304}}  # fmt: skip
    cfg = model_config_from_hf(hf)
    assert cfg.family is ModelFamily.deepseek_v3 and cfg.text_prefix == "language_model."
    assert (cfg.num_experts, cfg.num_shared_experts, cfg.q_lora_rank, cfg.num_key_value_heads) == (
        384,
        1,
        1536,
        64,
    )
    assert (cfg.vision_num_layers, cfg.vision_hidden_size, cfg.vision_intermediate_size) == (27, 1152, 4304)


def test_unknown_model_type_and_missing_field_are_named():
    with pytest.raises(HFConfigError, match="'llama'"):
        model_config_from_hf({"model_type": "llama"})
    with pytest.raises(HFConfigError, match="n_routed_experts"):
        model_config_from_hf({k: v for k, v in KIMI_TEXT.items() if k != "n_routed_experts"})
