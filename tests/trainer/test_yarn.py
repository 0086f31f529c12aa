"""YaRN rotary scaling (`model.rope_scaling`): read from a Kimi-K2-style config.json (`rope_scaling` with
`type`) and a transformers 5 one (`rope_parameters`), written back so transformers reads the same YaRN,
and the native model (transformers' DeepseekV3 with skyq's ops) computing what transformers' own
DeepseekV3 computes from that Kimi-style config."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from skyq.checkpoint.hf_config import (
    HFConfigError,
    architecture_mismatches,
    checkpoint_config_json,
    model_config_from_hf,
)
from skyq.config.enums import RopeScaling
from skyq.config.schema import RopeScalingConfig
from skyq.config.store import compose, to_object
from skyq.config.validate import ConfigValidationError, validate
from skyq.trainer.native.model import build_model

YARN = RopeScalingConfig(
    type=RopeScaling.yarn,
    factor=8.0,
    original_max_position_embeddings=16,
    beta_fast=4.0,
    beta_slow=1.0,
    mscale=1.0,
    mscale_all_dim=0.5,  # != mscale: YaRN scales cos/sin as well as the softmax
)
"""A tiny YaRN: positions past 16 are in the extended range the test's 48-token rows reach."""


@pytest.fixture(scope="module")
def yarn_model_cfg():
    base = to_object(compose(["model=tiny_deepseek"])).model
    return dataclasses.replace(base, rope_scaling=YARN)


def _kimi_style(config: dict) -> dict:
    """`config` (skyq's text config.json) as Kimi-K2 releases spell rope: `rope_theta` beside a
    `rope_scaling` dict whose kind is `type`."""
    text = dict(config["text_config"])
    rope = text.pop("rope_parameters")
    text["rope_theta"] = rope.pop("rope_theta")
    rope["type"] = rope.pop("rope_type")
    text["rope_scaling"] = rope
    return text


def test_yarn_round_trips_through_both_config_json_spellings(yarn_model_cfg):
    written = checkpoint_config_json(yarn_model_cfg)
    rope = written["text_config"]["rope_parameters"]
    assert rope["rope_type"] == "yarn" and rope["factor"] == 8.0 and rope["mscale_all_dim"] == 0.5
    assert model_config_from_hf(written).rope_scaling == YARN
    assert model_config_from_hf(_kimi_style(written)).rope_scaling == YARN
    assert architecture_mismatches(written, yarn_model_cfg) == []
    plain = dataclasses.replace(yarn_model_cfg, rope_scaling=RopeScalingConfig())
    assert model_config_from_hf(checkpoint_config_json(plain)).rope_scaling == RopeScalingConfig()
    (wrong,) = architecture_mismatches(written, plain)
    assert wrong.startswith("model.rope_scaling: checkpoint RopeScalingConfig(type=<RopeScaling.yarn")


def test_an_unsupported_rope_type_is_refused_naming_it(yarn_model_cfg):
    text = _kimi_style(checkpoint_config_json(yarn_model_cfg))
    text["rope_scaling"]["type"] = "longrope"
    with pytest.raises(HFConfigError, match="rope type 'longrope' is not supported"):
        model_config_from_hf(text)


def test_native_yarn_model_equals_transformers_deepseek_v3_from_the_kimi_style_config(yarn_model_cfg):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    native = build_model(yarn_model_cfg, seed=0).eval()
    kimi = _kimi_style(checkpoint_config_json(yarn_model_cfg))
    reference_cfg = DeepseekV3Config(**{k: v for k, v in kimi.items() if k not in ("architectures", "dtype")})
    reference = DeepseekV3ForCausalLM(reference_cfg).eval()
    reference.load_state_dict(native.state_dict())
    assert reference.config.rope_parameters["rope_type"] == "yarn"

    ids = torch.randint(0, yarn_model_cfg.vocab_size, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, want = native(input_ids=ids).logits, reference(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # the rotary frequencies, the cos/sin factor and the MLA softmax scale are YaRN's
    rotary = native.model.rotary_emb
    assert torch.equal(rotary.inv_freq, reference.model.rotary_emb.inv_freq)
    assert rotary.attention_scaling == pytest.approx(
        (1 + 0.1 * 1.0 * 2.0794415) / (1 + 0.1 * 0.5 * 2.0794415)
    )
    qk_dim = yarn_model_cfg.qk_nope_head_dim + yarn_model_cfg.qk_rope_head_dim
    softmax_scale = native.model.layers[0].self_attn.scaling
    assert softmax_scale == pytest.approx(qk_dim**-0.5 * (1 + 0.1 * 0.5 * 2.0794415) ** 2)

    # and YaRN changes the function: plain RoPE from the same weights gives other logits
    plain = build_model(dataclasses.replace(yarn_model_cfg, rope_scaling=RopeScalingConfig()), seed=0).eval()
    plain.load_state_dict(native.state_dict())
    with torch.no_grad():
        assert (plain(input_ids=ids).logits - want).abs().max() > 1e-3


def _validation_errors(cfg) -> list[str]:
    with pytest.raises(ConfigValidationError) as refused:
        validate(cfg)
    return refused.value.errors


def test_yarn_with_megatron_is_accepted_for_mla_and_refused_for_gqa_naming_the_key(yarn_model_cfg):
    cfg = to_object(compose(["model=tiny_deepseek", "trainer=megatron", "precision=bf16"]))
    validate(dataclasses.replace(cfg, model=yarn_model_cfg))  # MLA: megatron's own YaRN
    qwen = to_object(compose(["trainer=megatron", "precision=bf16"]))
    qwen = dataclasses.replace(qwen, model=dataclasses.replace(qwen.model, rope_scaling=YARN))
    (error,) = _validation_errors(qwen)
    assert error.startswith("model.rope_scaling.type=yarn with trainer=megatron and model.family=qwen3_moe")


def test_an_mscale_transformers_would_ignore_is_refused(yarn_model_cfg):
    cfg = to_object(compose(["model=tiny_deepseek"]))
    odd = dataclasses.replace(YARN, mscale=0.8, mscale_all_dim=0.0)
    (error,) = _validation_errors(
        dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, rope_scaling=odd))
    )
    assert error.startswith("model.rope_scaling.mscale=0.8 with model.rope_scaling.mscale_all_dim=0")
