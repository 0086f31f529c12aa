"""skyq configs -> megatron-core TransformerConfig (pure; megatron-core imported, nothing built).

The presets compose the way a run does (`skyq.config.store.compose`), and the Qwen3-MoE mapping is
checked against the transformers config skyq itself builds from the same ModelConfig (hf_config).
The GPU side (TE spec, FP8) is checked on `config_kwargs`: constructing a config with `fp8` set asks
Transformer Engine for its version, which a CPU box does not have.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("megatron.core", reason="megatron-core is not installed (dev extra, Python < 3.12)")

from skyq.checkpoint.hf_config import hf_config  # noqa: E402
from skyq.config.enums import Precision, QuantScope, RecomputeGranularity, RecomputeMethod  # noqa: E402
from skyq.config.schema import (  # noqa: E402
    ModelConfig,
    ParallelConfig,
    PrecisionConfig,
    RecomputeConfig,
    TrainerConfig,
)
from skyq.config.store import compose, to_object  # noqa: E402
from skyq.trainer.megatron import compat  # noqa: E402
from skyq.trainer.megatron.config import (  # noqa: E402
    ROUTED_EXPERTS_PATTERN,
    MegatronConfigError,
    config_kwargs,
    transformer_config,
)


def preset(name: str) -> ModelConfig:
    return to_object(compose([f"model={name}"])).model


def build(model_cfg: ModelConfig, device: str = "cpu", *, precision=None, trainer=None, parallel=None):
    return transformer_config(
        model_cfg,
        precision or PrecisionConfig(),
        trainer or TrainerConfig(),
        parallel or ParallelConfig(),
        device=device,
    )


def kwargs(model_cfg: ModelConfig, device: str = "cuda", *, precision=None, trainer=None, parallel=None):
    return config_kwargs(
        model_cfg,
        precision or PrecisionConfig(),
        trainer or TrainerConfig(),
        parallel or ParallelConfig(),
        device=device,
    )


@pytest.mark.parametrize("name", ["tiny_moe", "qwen3_30b"])
def test_qwen3_moe_presets_map_the_hf_config_skyq_builds(name):
    model_cfg = preset(name)
    hf = hf_config(model_cfg)
    c = build(model_cfg)
    assert type(c).__name__ == "TransformerConfig"
    assert (c.num_layers, c.hidden_size, c.num_attention_heads) == (
        hf.num_hidden_layers,
        hf.hidden_size,
        hf.num_attention_heads,
    )
    assert (c.num_query_groups, c.kv_channels) == (hf.num_key_value_heads, hf.head_dim)
    assert (c.num_moe_experts, c.moe_router_topk, c.moe_ffn_hidden_size) == (
        hf.num_experts,
        hf.num_experts_per_tok,
        hf.moe_intermediate_size,
    )
    assert c.layernorm_epsilon == hf.rms_norm_eps and c.normalization == "RMSNorm"
    assert c.qk_layernorm and c.gated_linear_unit and c.activation_func is F.silu
    assert not c.add_bias_linear and not c.add_qkv_bias
    # softmax over the top-k logits == HF's softmax, top-k, renormalise (norm_topk_prob=True)
    assert hf.norm_topk_prob and c.moe_router_score_function == "softmax" and not c.moe_router_pre_softmax
    assert c.moe_router_load_balancing_type == "none" and c.moe_layer_freq == 1
    assert c.hidden_dropout == 0.0 and c.attention_dropout == 0.0
    assert c.params_dtype == torch.float32 and c.use_cpu_initialization and not c.moe_grouped_gemm


def test_qwen3_30b_key_fields():
    c = build(preset("qwen3_30b"))
    assert (c.num_layers, c.num_query_groups, c.kv_channels, c.num_moe_experts, c.moe_router_topk) == (
        48,
        4,
        128,
        128,
        8,
    )


def test_kimi_k26_is_mla_with_shared_experts_dense_first_layer_and_sigmoid_routing():
    model_cfg = preset("kimi_k26")
    c = build(model_cfg)
    assert type(c).__name__ == "MLATransformerConfig" and c.multi_latent_attention
    assert (c.q_lora_rank, c.kv_lora_rank) == (1536, 512)
    assert (c.qk_head_dim, c.qk_pos_emb_head_dim, c.v_head_dim) == (128, 64, 128)
    assert c.rope_type == "yarn" and c.rotary_base == 50000.0  # the 256k release's YaRN
    assert (c.rotary_scaling_factor, c.original_max_position_embeddings) == (64.0, 4096)
    assert (c.beta_fast, c.beta_slow, c.mscale, c.mscale_all_dim) == (1.0, 1.0, 1.0, 1.0)
    assert c.moe_layer_freq == [0] + [1] * 60
    assert c.ffn_hidden_size == 18432  # the dense first layer
    assert c.moe_shared_expert_intermediate_size == 2048
    assert (c.num_moe_experts, c.moe_router_topk, c.moe_ffn_hidden_size) == (384, 8, 2048)
    assert c.moe_router_score_function == "sigmoid" and c.moe_router_enable_expert_bias
    assert c.moe_router_bias_update_rate == 0.0  # the checkpoint's e_score_correction_bias stays
    assert c.moe_router_num_groups is None  # Kimi-K2: n_group = topk_group = 1, no group limit
    assert c.moe_router_topk_scaling_factor == 2.827  # model.routed_scaling_factor


def test_deepseek_v3_group_limited_routing_maps_to_megatron_groups():
    model_cfg = ModelConfig(
        **{
            **vars(preset("kimi_k26")),
            "n_group": 8,
            "topk_group": 4,
            "routed_scaling_factor": 2.5,
        }
    )
    c = build(model_cfg)
    assert (c.moe_router_num_groups, c.moe_router_group_topk, c.moe_router_topk_scaling_factor) == (8, 4, 2.5)


def test_mla_without_q_lora_keeps_q_lora_rank_none():
    model_cfg = ModelConfig(**{**vars(preset("kimi_k26")), "q_lora_rank": None})
    assert build(model_cfg).q_lora_rank is None


def test_parallel_layout_and_recompute_map_to_megatron_fields():
    trainer = TrainerConfig(
        recompute=RecomputeConfig(
            granularity=RecomputeGranularity.full, method=RecomputeMethod.block, num_layers=2
        )
    )
    parallel = ParallelConfig(
        tp=2, ep=4, etp=1, pp=2, sequence_parallel=True, first_stage_layers=20, last_stage_layers=28
    )
    c = build(preset("qwen3_30b"), trainer=trainer, parallel=parallel)
    assert (c.tensor_model_parallel_size, c.expert_model_parallel_size, c.pipeline_model_parallel_size) == (
        2,
        4,
        2,
    )
    assert c.expert_tensor_parallel_size == 1 and c.sequence_parallel
    assert (c.num_layers_in_first_pipeline_stage, c.num_layers_in_last_pipeline_stage) == (20, 28)
    assert (c.recompute_granularity, c.recompute_method, c.recompute_num_layers) == ("full", "block", 2)
    selective = TrainerConfig(recompute=RecomputeConfig(granularity=RecomputeGranularity.selective))
    c = build(preset("tiny_moe"), trainer=selective)
    assert (c.recompute_granularity, c.recompute_method, c.recompute_num_layers) == ("selective", None, None)
    assert build(preset("tiny_moe")).recompute_granularity is None


def test_gpu_uses_bf16_params_and_grouped_gemm():
    assert kwargs(preset("qwen3_30b"), "cuda:3") == kwargs(preset("qwen3_30b"), "cuda")
    name, kw = kwargs(preset("qwen3_30b"))
    assert name == "TransformerConfig"
    assert kw["params_dtype"] == torch.bfloat16 and kw["bf16"] and kw["moe_grouped_gemm"]
    assert not kw["use_cpu_initialization"]
    assert "fp8" not in kw  # bf16 precision


def test_gradient_accumulation_fusion_where_the_gpu_has_it(monkeypatch):
    from skyq.trainer.megatron import config

    model_cfg = preset("tiny_moe")
    for installed in (False, True):
        monkeypatch.setattr(config, "_apex_wgrad_fusion_installed", lambda installed=installed: installed)
        assert kwargs(model_cfg)[1]["gradient_accumulation_fusion"] is installed
        assert kwargs(model_cfg, "cpu")[1]["gradient_accumulation_fusion"] is False
    for asked in (False, True):
        fused = config_kwargs(
            model_cfg, PrecisionConfig(), TrainerConfig(), ParallelConfig(), device="cuda",
            gradient_accumulation_fusion=asked,
        )[1]["gradient_accumulation_fusion"]  # fmt: skip
        assert fused is asked
    with pytest.raises(MegatronConfigError, match="gradient_accumulation_fusion=True on the CPU"):
        config_kwargs(
            model_cfg, PrecisionConfig(), TrainerConfig(), ParallelConfig(), device="cpu",
            gradient_accumulation_fusion=True,
        )  # fmt: skip


def _matched(recipe, path: str) -> str | None:
    from megatron.core.quantization.quant_config import MatchContext

    return recipe.match_to_config_key(MatchContext(module_path=path, layer_number=0))


def test_fp8_blockwise_on_all_linears_is_the_global_te_recipe_with_persistent_params():
    precision = PrecisionConfig(
        name=Precision.fp8_blockwise, fp8_targets=QuantScope.all_linear, persistent_fp8_params=True
    )
    _, kw = kwargs(preset("qwen3_30b"), precision=precision)
    assert (kw["fp8"], kw["fp8_recipe"], kw["fp8_param"]) == ("e4m3", "blockwise", True)
    assert "quant_recipe" not in kw


@pytest.mark.parametrize(
    "precision",
    [
        PrecisionConfig(name=Precision.mxfp8),  # mxfp8_targets defaults to routed_experts
        PrecisionConfig(name=Precision.fp8_blockwise, fp8_targets=QuantScope.routed_experts),
    ],
    ids=["mxfp8", "fp8_blockwise"],
)
def test_routed_experts_only_fp8_keeps_every_other_te_linear_bf16(precision):
    from megatron.core.extensions.transformer_engine import TEQuantizationParams

    _, kw = kwargs(preset("kimi_k26"), precision=precision)
    recipe = "mxfp8" if precision.name is Precision.mxfp8 else "blockwise"
    assert (kw["fp8"], kw["fp8_recipe"]) == ("e4m3", recipe)
    q = kw["quant_recipe"]
    assert ROUTED_EXPERTS_PATTERN == "*.mlp.experts.*"
    assert _matched(q, "decoder.layers.3.mlp.experts.linear_fc1") == "global_recipe"
    for path in (
        "decoder.layers.3.mlp.shared_experts.linear_fc1",
        "decoder.layers.0.mlp.linear_fc1",
        "decoder.layers.3.self_attention.linear_kv_up_proj",
        "decoder.layers.3.self_attention.linear_proj",
    ):
        assert _matched(q, path) == "bf16", path
    # both configs parse as Megatron's TE per-module parameters (no TE needed to parse)
    experts = TEQuantizationParams.parse_from_config(
        q.match(_context("decoder.layers.3.mlp.experts.linear_fc2"))
    )
    assert experts.training_recipe.fp8_quantization_recipe is None
    assert not experts.training_recipe.override_quantized_autocast  # the global recipe runs
    other = TEQuantizationParams.parse_from_config(
        q.match(_context("decoder.layers.3.self_attention.linear_proj"))
    )
    assert other.training_recipe.fp8_quantization_recipe is None
    assert other.training_recipe.override_quantized_autocast  # fp8_autocast(enabled=False)


def _context(path: str):
    from megatron.core.quantization.quant_config import MatchContext

    return MatchContext(module_path=path, layer_number=3)


def test_deepep_is_refused_where_its_package_is_missing():
    """`deep_ep` is a CUDA/NVSHMEM build: absent here (and on the lent H200), so a GPU build with DeepEP
    on stops before megatron-core's first dispatch, naming the key."""
    import importlib.util

    from skyq.trainer.megatron.config import MegatronConfigError, require_deepep

    assert importlib.util.find_spec("deep_ep") is None
    with pytest.raises(MegatronConfigError, match="trainer.deepep_max_dispatch_tokens=128: DeepEP"):
        require_deepep(TrainerConfig(deepep_max_dispatch_tokens=128))
    require_deepep(TrainerConfig())  # DeepEP off: nothing to check


def test_deepep_switches_the_flex_dispatcher_on_the_gpu():
    _, kw = kwargs(preset("kimi_k26"), trainer=TrainerConfig(deepep_max_dispatch_tokens=128))
    assert kw["moe_token_dispatcher_type"] == "flex" and kw["moe_flex_dispatcher_backend"] == "deepep"
    _, kw = kwargs(preset("kimi_k26"), trainer=TrainerConfig(moe_token_dispatcher="allgather"))
    assert kw["moe_token_dispatcher_type"] == "allgather"


REFUSALS = [
    ("fp8 on the CPU", dict(precision=PrecisionConfig(name=Precision.fp8_blockwise)), "cpu", "needs a GPU"),
    ("mxfp8 on the CPU", dict(precision=PrecisionConfig(name=Precision.mxfp8)), "cpu", "needs a GPU"),
    (
        "persistent fp8 with mxfp8",
        dict(precision=PrecisionConfig(name=Precision.mxfp8, persistent_fp8_params=True)),
        "cuda",
        "precision.persistent_fp8_params=true",
    ),
    (
        "persistent fp8 with expert-only blockwise",
        dict(
            precision=PrecisionConfig(
                name=Precision.fp8_blockwise,
                fp8_targets=QuantScope.routed_experts,
                persistent_fp8_params=True,
            )
        ),  # fmt: skip
        "cuda",
        "precision.persistent_fp8_params=true",
    ),
    (
        "a block TE does not have",
        dict(precision=PrecisionConfig(name=Precision.fp8_blockwise, block_size=[64, 64])),
        "cuda",
        "precision.block_size=[64, 64]",
    ),
    ("DeepEP on the CPU", dict(trainer=TrainerConfig(deepep_max_dispatch_tokens=64)), "cpu", "DeepEP"),
    ("flex without DeepEP", dict(trainer=TrainerConfig(moe_token_dispatcher="flex")), "cuda", "flex"),
    ("unknown dispatcher", dict(trainer=TrainerConfig(moe_token_dispatcher="a2a")), "cuda", "'a2a'"),
    ("sp with tp 1", dict(parallel=ParallelConfig(sequence_parallel=True)), "cpu", "sequence_parallel=true"),
    ("cp on the CPU", dict(parallel=ParallelConfig(cp=2)), "cpu", "topology.parallel.cp=2"),
    ("MLA tp2 without sp", dict(parallel=ParallelConfig(tp=2)), "cuda", "sequence_parallel=true"),
    ("unknown device", dict(), "tpu", "device='tpu'"),
    ("unknown device with an index", dict(), "tpu:0", "device='tpu:0'"),
]


@pytest.mark.parametrize(
    ("overrides", "device", "needle"), [r[1:] for r in REFUSALS], ids=[r[0] for r in REFUSALS]
)
def test_refusals_are_one_clear_line(overrides, device, needle):
    with pytest.raises(MegatronConfigError) as err:
        kwargs(preset("kimi_k26"), device, **overrides)
    message = str(err.value)
    assert needle in message and "\n" not in message


def test_mla_needs_its_head_dims():
    model_cfg = ModelConfig(**{**vars(preset("kimi_k26")), "kv_lora_rank": 0})
    with pytest.raises(MegatronConfigError, match="kv_lora_rank"):
        kwargs(model_cfg)


def test_megatron_core_refusals_come_back_naming_the_skyq_configs():
    # 32 heads do not split over tp=3: megatron-core's own check, wrapped
    with pytest.raises(MegatronConfigError, match=r"megatron-core refused the TransformerConfig.*qwen3_30b"):
        build(preset("qwen3_30b"), parallel=ParallelConfig(tp=3))


def test_unsupported_megatron_core_version_is_refused(monkeypatch):
    monkeypatch.setattr(compat, "installed_version", lambda: (0, 15, 0))
    with pytest.raises(compat.MegatronVersionError, match=r"0\.15\.0 is installed.*0\.16\.1.*0\.19\.2"):
        build(preset("tiny_moe"))
    assert compat.SUPPORTED_VERSIONS.keys() == {(0, 16, 1), (0, 19, 2)}


def test_a_field_the_installed_version_lacks_is_named():
    from megatron.core.transformer.transformer_config import TransformerConfig

    with pytest.raises(
        compat.MegatronVersionError, match=r"TransformerConfig has no field\(s\) \['not_a_field'\]"
    ):
        compat.build_config(TransformerConfig, {"num_layers": 2, "not_a_field": 1})


def test_every_field_skyq_sets_exists_in_the_installed_config_classes():
    import dataclasses

    from megatron.core.transformer import transformer_config as tc

    precision = PrecisionConfig(name=Precision.fp8_blockwise, persistent_fp8_params=True, fp8_targets=QuantScope.all_linear)  # fmt: skip
    trainer = TrainerConfig(
        deepep_max_dispatch_tokens=8, recompute=RecomputeConfig(granularity=RecomputeGranularity.full)
    )
    parallel = ParallelConfig(tp=2, sequence_parallel=True, first_stage_layers=1, last_stage_layers=1)
    for model in ("qwen3_30b", "kimi_k26"):
        name, kw = kwargs(preset(model), precision=precision, trainer=trainer, parallel=parallel)
        fields = {f.name for f in dataclasses.fields(getattr(tc, name))}
        assert set(kw) <= fields, sorted(set(kw) - fields)


def test_importing_the_package_imports_no_megatron():
    code = "import sys, skyq.trainer.megatron; assert 'megatron' not in sys.modules, 'megatron imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
