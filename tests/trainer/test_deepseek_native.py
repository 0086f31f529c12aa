"""The native trainer on DeepSeek-V3 (model=tiny_deepseek, Kimi-K2.6's text architecture): built from
config, its checkpoint, fp32 router bias, INT4 QAT on the layout's routed experts, GRPO steps in every precision."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from skyq.checkpoint.hf_config import ModelBuildError, hf_config, model_config_from_hf
from skyq.quant import int4
from skyq.quant.layouts import Role
from skyq.rl.batch import FinishReason, Sample, collate
from skyq.trainer.native.model import build_model, check_checkpoint_config

BIAS = "model.layers.1.mlp.gate.e_score_correction_bias"
"""The MoE layer's router bias, trainer name (the checkpoint's carries `language_model.`)."""


def _batch(seed: int = 0, rows: int = 16):
    """A random rollout batch: groups of 4 responses with random rewards and rollout log-probs."""
    gen = torch.Generator().manual_seed(seed)
    samples, rewards = [], []
    for r in range(rows):
        prompt = [1, 3 + r % 10, 13, 3 + (r * 7) % 10, 18]
        length = 1 + int(torch.randint(0, 3, (1,), generator=gen))
        response = torch.randint(3, 13, (length,), generator=gen).tolist()
        samples.append(
            Sample(prompt, response, (-torch.rand(length, generator=gen) * 3).tolist(), FinishReason.length)
        )
        rewards.append(float(torch.randint(0, 2, (1,), generator=gen)))
    return collate(samples, rewards, group_size=4, normalize_std=True, pad_token_id=0)


def test_the_model_is_deepseek_v3_with_mla_a_dense_first_layer_a_shared_expert_and_a_router_bias(
    deepseek_cfg,
):
    model_cfg = deepseek_cfg().model
    config = hf_config(model_cfg)
    assert (
        type(config).__name__ == "DeepseekV3Config" and config.rope_interleave and config.num_mtp_layers == 0
    )
    assert (config.n_routed_experts, config.n_shared_experts, config.first_k_dense_replace) == (4, 1, 1)
    assert (config.q_lora_rank, config.kv_lora_rank, config.routed_scaling_factor) == (32, 32, 2.827)
    assert config.num_key_value_heads == config.num_attention_heads  # MLA: a key and value per head
    model = build_model(model_cfg, seed=0)
    params = dict(model.named_parameters())
    assert {"model.layers.0.mlp.gate_proj.weight", "model.layers.1.mlp.experts.gate_up_proj"} <= set(params)
    assert {
        "model.layers.1.mlp.shared_experts.up_proj.weight",
        "model.layers.0.self_attn.q_a_proj.weight",
    } <= set(params)
    assert "model.layers.0.mlp.experts.gate_up_proj" not in params  # the first layer is dense
    bias = params[BIAS]
    assert bias.dtype == torch.float32 and not bias.requires_grad and bool(bias.abs().gt(0).all())
    assert not torch.equal(bias, bias.to(torch.bfloat16).float())  # a bf16 copy would change it
    assert torch.equal(build_model(model_cfg, seed=0).get_parameter(BIAS), bias)  # seeded
    assert not torch.equal(build_model(model_cfg, seed=1).get_parameter(BIAS), bias)


def test_the_checkpoint_is_kimi_shaped_and_keeps_the_router_bias_in_fp32(deepseek_cfg, deepseek_checkpoint):
    """Text weights under `language_model.` with config.json's text model under `text_config` (so
    converters and inspect read the same model config back), the bias stored in fp32."""
    from safetensors.torch import load_file

    model_cfg = deepseek_cfg().model
    config = json.loads((Path(deepseek_checkpoint) / "config.json").read_text())
    assert config["architectures"] == ["KimiK25ForConditionalGeneration"]
    assert config["text_config"]["architectures"] == ["DeepseekV3ForCausalLM"]
    assert config["text_config"]["scoring_func"] == "sigmoid"
    back = model_config_from_hf(config)
    for field in dataclasses.fields(model_cfg):
        if field.name not in ("name", "head_dim", "init_seed", "init_sft_steps"):
            assert getattr(back, field.name) == getattr(model_cfg, field.name), field.name
    tensors = load_file(str(Path(deepseek_checkpoint) / "model.safetensors"))
    assert all(name.startswith("language_model.") for name in tensors)
    assert tensors[f"language_model.{BIAS}"].dtype == torch.float32
    assert {t.dtype for n, t in tensors.items() if not n.endswith("e_score_correction_bias")} == {
        torch.bfloat16
    }


@pytest.mark.parametrize("model", ["tiny_moe", "tiny_deepseek", "small_moe"])
def test_a_written_config_json_reads_back_as_the_model_config(model):
    """What skyq writes as a checkpoint's config.json gives the model config back (converters and
    inspect rebuild it from there), for both families, dense widths included."""
    from skyq.checkpoint.hf_config import checkpoint_config_json
    from skyq.config.store import compose, to_object

    model_cfg = to_object(compose([f"model={model}"])).model
    back = model_config_from_hf(checkpoint_config_json(model_cfg))
    skip = {"name", "init_seed", "init_sft_steps"} | ({"head_dim"} if model == "tiny_deepseek" else set())
    for field in dataclasses.fields(model_cfg):
        if field.name not in skip:
            assert getattr(back, field.name) == getattr(model_cfg, field.name), field.name


def test_a_checkpoint_of_another_routing_is_refused_naming_the_key(deepseek_cfg, deepseek_checkpoint):
    other = dataclasses.replace(deepseek_cfg().model, routed_scaling_factor=2.5)
    with pytest.raises(
        ModelBuildError, match=r"model\.routed_scaling_factor: checkpoint 2\.827 != model config 2\.5"
    ):
        check_checkpoint_config(deepseek_checkpoint, other)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"num_nextn_predict_layers": 1}, "no multi-token-prediction layers"),
        ({"num_key_value_heads": 2}, r"model.num_key_value_heads=2: MLA expands one key and value per head"),
        ({"num_shared_experts": 0}, "always hold a shared expert"),
        ({"n_group": 3}, "n_group must divide model.num_experts=4"),
        (
            {"vision_num_layers": 2, "vision_hidden_size": 32, "vision_intermediate_size": 64},
            "model.vision_hidden_size=32: the vision tower's heads are 72 wide",
        ),
    ],
)
def test_what_transformers_cannot_build_is_refused(deepseek_cfg, change, message):
    with pytest.raises(ModelBuildError, match=message):
        hf_config(dataclasses.replace(deepseek_cfg().model, **change))


@pytest.mark.parametrize("compute_dtype", ["fp32", "bf16"])
def test_the_router_bias_reaches_the_wire_and_the_forward_in_fp32(make_deepseek_trainer, compute_dtype):
    trainer = make_deepseek_trainer("bf16", compute_dtype=compute_dtype)
    master = trainer.model.get_parameter(BIAS)
    weights = dict(trainer.hf_weights())
    assert weights[f"language_model.{BIAS}"].dtype == torch.float32
    assert torch.equal(weights[f"language_model.{BIAS}"], master)
    items = dict(item for item in trainer.hf_weight_items() if isinstance(item[0], str))
    assert torch.equal(items[f"language_model.{BIAS}"], master)
    effective = trainer.effective_parameters()
    assert effective[BIAS].dtype == torch.float32 and torch.equal(effective[BIAS], master)
    assert effective["model.norm.weight"].dtype == trainer.compute_dtype


def test_int4_qat_fake_quantizes_the_routed_experts_only(make_deepseek_trainer):
    trainer = make_deepseek_trainer("int4_qat")
    cfg, group = trainer.model_cfg, trainer.precision_cfg.int4_group_size
    effective, masters = trainer.effective_parameters(), dict(trainer.model.named_parameters())
    quantized = {
        name
        for name, master in masters.items()
        if not torch.equal(effective[name], master.detach().to(torch.bfloat16).to(master.dtype))
    } - {BIAS}
    assert torch.equal(effective[BIAS], masters[BIAS])  # fp32, not rounded
    assert quantized == {f"model.layers.1.mlp.experts.{leaf}" for leaf in ("gate_up_proj", "down_proj")}, (
        "qat_scope=routed_experts: attention, the dense layer and the shared expert stay bf16"
    )
    assert trainer.layout.role("model.layers.1.mlp.experts.down_proj", cfg) is Role.routed_expert
    down = masters["model.layers.1.mlp.experts.down_proj"].detach().to(torch.bfloat16)
    for e in range(cfg.num_experts):  # each expert's own groups, the serializer's values
        packed, scale = int4.quantize_packed(down[e], group_size=group, grid=trainer.precision_cfg.int4_grid)
        expected = int4.dequantize_packed(packed, scale, tuple(down[e].shape), group_size=group)
        assert torch.equal(effective["model.layers.1.mlp.experts.down_proj"][e].to(torch.bfloat16), expected)


@pytest.mark.parametrize("precision", ["bf16", "fp8_blockwise", "mxfp8", "int4_qat"])
def test_grpo_steps_train_every_weight_but_the_frozen_router_bias(make_deepseek_trainer, precision):
    trainer = make_deepseek_trainer(precision)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    for step in range(2):
        metrics = trainer.train_step(_batch(seed=step))
        assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values()), metrics
    after = dict(trainer.model.named_parameters())
    unchanged = {n for n in before if torch.equal(before[n], after[n])}
    assert unchanged == {BIAS}, sorted(unchanged)
    assert trainer.step == 2
