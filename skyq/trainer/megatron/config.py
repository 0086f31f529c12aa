"""skyq's typed model / precision / trainer / parallel configs -> a megatron-core `TransformerConfig`.

Pure: no process group, no device, no Transformer Engine import (its absence on the CPU is what the
FP8 refusals name). `transformer_config` is the only entry point; the worker passes its result to
`skyq.trainer.megatron.model.build_model` (which calls it itself).

The two families, as skyq's HF configs define them (`skyq.checkpoint.hf_config`):

- qwen3_moe: GQA (`num_query_groups = num_key_value_heads`, `kv_channels = head_dim`), per-head
  RMSNorm on q and k (`qk_layernorm`), SwiGLU experts, softmax top-k routing renormalised over the
  top k (HF `norm_topk_prob=True`; Megatron's softmax after top-k on the logits is the same
  function), every layer MoE, no aux loss (RL updates, as the native trainer).
- deepseek_v3 (DeepSeek-V3, Kimi-K2.x): MLA (`MLATransformerConfig`, q_lora_rank None = a plain
  q projection), shared experts of width `num_shared_experts * moe_intermediate_size`, the first
  `first_k_dense_replace` layers dense (`moe_layer_freq` list), sigmoid routing with the expert
  bias (`e_score_correction_bias`) used for selection only, top-k weights renormalised.
  The expert bias is kept as loaded (`moe_router_bias_update_rate=0`): the HF model and the engine
  hold it as a fixed buffer, and an RL update must not move the routing under the engine.

  Group-limited top-k (`model.n_group` / `topk_group` -> `moe_router_num_groups` / `group_topk`;
  Kimi-K2 uses 1 / 1, i.e. no group limit, DeepSeek-V3 8 / 4) and `model.routed_scaling_factor`
  (-> `moe_router_topk_scaling_factor`) are read. `model.rope_scaling` type=yarn -> MLA's
  `rope_type="yarn"` with its factor, original length, betas and mscales (the same frequencies,
  cos/sin factor and softmax scale as transformers' DeepseekV3; on the CPU `YarnRotaryEmbedding`'s
  move to `torch.cuda.current_device()` lands on the CPU through `cpu_compat`). qwen3_moe with YaRN
  is refused.

FP8 (GPU only; Transformer Engine): precision=fp8_blockwise -> `fp8="e4m3"`, `fp8_recipe="blockwise"`
(TE `Float8BlockScaling`; its fp32-vs-pow2 scales come from NVTE_FP8_BLOCK_SCALING_FP32_SCALES in the
worker's environment, the strategy's `env_vars`), precision=mxfp8 -> `fp8_recipe="mxfp8"`. The
precision's targets choose the linears: all_linear is the global recipe; routed_experts adds a
per-module `quant_recipe` (megatron/core/quantization, 0.16.1) that forces every other TE linear
back to bf16. `precision.persistent_fp8_params` -> `fp8_param` (blockwise on all linears only).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from skyq.config.enums import (
    ComputeDtype,
    ModelFamily,
    Precision,
    QuantScope,
    RecomputeGranularity,
    RopeScaling,
)
from skyq.config.schema import ModelConfig, ParallelConfig, PrecisionConfig, TrainerConfig
from skyq.trainer.megatron import compat

DEVICES = ("cpu", "cuda")

ROUTED_EXPERTS_PATTERN = "*.mlp.experts.*"
"""Glob on Megatron module paths matching the routed experts' linears only (`mlp.shared_experts`
and attention do not match): `decoder.layers.{i}.mlp.experts.linear_fc1` (TE spec)."""

TE_FP8_BLOCK = (128, 128)
TE_FP8_ACTIVATION_TILE = 128


class MegatronConfigError(ValueError):
    """A skyq config trainer=megatron cannot run as asked (one line naming the key and the fix)."""


def transformer_config(
    model_cfg: ModelConfig,
    precision_cfg: PrecisionConfig,
    trainer_cfg: TrainerConfig,
    parallel_cfg: ParallelConfig,
    *,
    device: str,
    gradient_accumulation_fusion: bool | None = None,
) -> Any:
    """The megatron-core `TransformerConfig` (qwen3_moe) or `MLATransformerConfig` (deepseek_v3)
    of these configs on `device` ("cpu": local spec, fp32 params, no TE; "cuda" / "cuda:N": TE spec).

    `gradient_accumulation_fusion`: weight gradients added straight into Megatron's fp32 `main_grad`
    inside the GEMMs (GPU only). None: on with CUDA where Apex's `fused_weight_gradient_mlp_cuda`
    is installed (megatron-core's own ColumnParallelLinear, the output layer, refuses it otherwise)."""
    compat.check_version()
    name, kwargs = config_kwargs(
        model_cfg,
        precision_cfg,
        trainer_cfg,
        parallel_cfg,
        device=device,
        gradient_accumulation_fusion=gradient_accumulation_fusion,
    )
    from megatron.core.transformer import transformer_config as tc

    cls = getattr(tc, name)
    try:
        return compat.build_config(cls, kwargs)
    except (ValueError, AssertionError) as err:
        raise MegatronConfigError(
            f"megatron-core refused the {name} built from model={model_cfg.name}, "
            f"precision={Precision(precision_cfg.name).value}, topology.parallel={parallel_cfg}: {err}"
        ) from err


def device_kind(device: str) -> str:
    """ "cpu" or "cuda" of a torch device string ("cuda:3" -> "cuda"), or MegatronConfigError."""
    kind = device.partition(":")[0]
    if kind not in DEVICES:
        raise MegatronConfigError(f"device={device!r}: expected cpu, cuda or cuda:<index>")
    return kind


def config_kwargs(
    model_cfg: ModelConfig,
    precision_cfg: PrecisionConfig,
    trainer_cfg: TrainerConfig,
    parallel_cfg: ParallelConfig,
    *,
    device: str,
    gradient_accumulation_fusion: bool | None = None,
) -> tuple[str, dict[str, Any]]:
    """(config class name, keyword arguments) of `transformer_config`, without constructing it:
    the dataclass's own checks import Transformer Engine for FP8, so the GPU mapping is testable
    on the CPU only here. Raises MegatronConfigError for what trainer=megatron refuses."""
    device = device_kind(device)
    if gradient_accumulation_fusion is None:
        gradient_accumulation_fusion = device == "cuda" and _apex_wgrad_fusion_installed()
    elif gradient_accumulation_fusion and device == "cpu":
        raise MegatronConfigError(
            "gradient_accumulation_fusion=True on the CPU: it is a CUDA kernel (TE / Apex). Fix: leave it None"
        )
    kwargs = {
        **_architecture(model_cfg),
        **_parallel(parallel_cfg, device),
        **_moe(model_cfg, trainer_cfg, device),
        **_recompute(trainer_cfg),
        **_dtypes(trainer_cfg, device),
        "gradient_accumulation_fusion": gradient_accumulation_fusion,
        **_fp8(precision_cfg, device),
    }
    if ModelFamily(model_cfg.family) is ModelFamily.deepseek_v3:
        if parallel_cfg.tp > 1 and not parallel_cfg.sequence_parallel:
            raise MegatronConfigError(
                f"model.family=deepseek_v3 with topology.parallel.tp={parallel_cfg.tp} needs "
                "topology.parallel.sequence_parallel=true: MLA's down-projections are replicated across "
                "TP, and only sequence parallelism gathers the rotary key and reduce-scatters its "
                "gradient across the TP heads (without it that gradient holds this rank's heads only). "
                "Fix: sequence_parallel=true"
            )
        return "MLATransformerConfig", {**kwargs, **_mla(model_cfg)}
    if RopeScaling(model_cfg.rope_scaling.type) is not RopeScaling.none:
        raise MegatronConfigError(
            f"model.rope_scaling.type={RopeScaling(model_cfg.rope_scaling.type).value} with "
            f"model.family={ModelFamily(model_cfg.family).value}: trainer=megatron applies YaRN in MLA "
            "(deepseek_v3) only. Fix: trainer=native, or model.rope_scaling.type=none"
        )
    return "TransformerConfig", {**kwargs, **_gqa(model_cfg)}


def _architecture(m: ModelConfig) -> dict[str, Any]:
    return {
        "num_layers": m.num_layers,
        "hidden_size": m.hidden_size,
        "num_attention_heads": m.num_attention_heads,
        "ffn_hidden_size": m.intermediate_size,
        "normalization": "RMSNorm",
        "layernorm_epsilon": m.rms_norm_eps,
        "gated_linear_unit": True,
        "activation_func": F.silu,
        "add_bias_linear": False,
        "add_qkv_bias": False,
        "qk_layernorm": True,
        # RL log-probs must be a deterministic function of the weights (trainer vs engine)
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
        # fused kernels are CUDA (apex / TE / jit); the unfused paths are the same math
        "masked_softmax_fusion": False,
        "bias_activation_fusion": False,
        "bias_dropout_fusion": False,
        "apply_rope_fusion": False,
        "persist_layer_norm": False,
    }


def _gqa(m: ModelConfig) -> dict[str, Any]:
    return {"num_query_groups": m.num_key_value_heads, "kv_channels": m.head_dim}


def _mla(m: ModelConfig) -> dict[str, Any]:
    if not (m.kv_lora_rank and m.qk_nope_head_dim and m.qk_rope_head_dim and m.v_head_dim):
        raise MegatronConfigError(
            f"model={m.name} (family deepseek_v3): MLA needs kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim "
            f"and v_head_dim > 0; got {m.kv_lora_rank}, {m.qk_nope_head_dim}, {m.qk_rope_head_dim}, "
            f"{m.v_head_dim}. Fix: set them in the model preset"
        )
    return {
        "multi_latent_attention": True,
        "q_lora_rank": m.q_lora_rank,
        "kv_lora_rank": m.kv_lora_rank,
        "qk_head_dim": m.qk_nope_head_dim,
        "qk_pos_emb_head_dim": m.qk_rope_head_dim,
        "v_head_dim": m.v_head_dim,
        "rotary_base": m.rope_theta,
        **_mla_rope(m),
    }


def _mla_rope(m: ModelConfig) -> dict[str, Any]:
    """MLA's rotary fields: plain rope, or YaRN as `model.rope_scaling` gives it. With rope_type "rope"
    megatron still computes the softmax scale from `mscale_all_dim` (its default 0 leaves it unscaled)."""
    y = m.rope_scaling
    if RopeScaling(y.type) is RopeScaling.none:
        return {"rope_type": "rope"}
    return {
        "rope_type": "yarn",
        "rotary_scaling_factor": y.factor,
        "original_max_position_embeddings": y.original_max_position_embeddings,
        "beta_fast": y.beta_fast,
        "beta_slow": y.beta_slow,
        "mscale": y.mscale,
        "mscale_all_dim": y.mscale_all_dim,
    }


def _parallel(p: ParallelConfig, device: str) -> dict[str, Any]:
    if p.sequence_parallel and p.tp == 1:
        raise MegatronConfigError(
            "topology.parallel.sequence_parallel=true with topology.parallel.tp=1: sequence parallelism "
            "splits along the TP group. Fix: tp > 1, or sequence_parallel=false"
        )
    if p.cp > 1 and device == "cpu":
        raise MegatronConfigError(
            f"topology.parallel.cp={p.cp} on the CPU: context parallelism needs Transformer Engine's "
            "attention (TEDotProductAttention), which needs a GPU. Fix: cp=1"
        )
    out = {
        "tensor_model_parallel_size": p.tp,
        "pipeline_model_parallel_size": p.pp,
        "context_parallel_size": p.cp,
        "expert_model_parallel_size": p.ep,
        "expert_tensor_parallel_size": p.etp,
        "sequence_parallel": p.sequence_parallel,
    }
    if p.first_stage_layers is not None:
        out["num_layers_in_first_pipeline_stage"] = p.first_stage_layers
    if p.last_stage_layers is not None:
        out["num_layers_in_last_pipeline_stage"] = p.last_stage_layers
    return out


def _moe(m: ModelConfig, t: TrainerConfig, device: str) -> dict[str, Any]:
    out: dict[str, Any] = {
        "num_moe_experts": m.num_experts,
        "moe_ffn_hidden_size": m.moe_intermediate_size,
        "moe_router_topk": m.num_experts_per_tok,
        "moe_router_load_balancing_type": "none",
        "moe_aux_loss_coeff": 0.0,
        "moe_router_dtype": "fp32",
        # TE's grouped GEMM on the GPU (TEGroupedMLP); the local spec's grouped MLP needs the
        # `grouped_gemm` CUDA package, so the CPU runs SequentialMLP (one linear pair per expert)
        "moe_grouped_gemm": device == "cuda",
        "moe_permute_fusion": False,
        "moe_token_dispatcher_type": _dispatcher(t, device),
    }
    if ModelFamily(m.family) is ModelFamily.deepseek_v3:
        if m.first_k_dense_replace:
            out["moe_layer_freq"] = [0] * m.first_k_dense_replace + [1] * (
                m.num_layers - m.first_k_dense_replace
            )
        if m.num_shared_experts:
            out["moe_shared_expert_intermediate_size"] = m.num_shared_experts * m.moe_intermediate_size
        out.update(
            moe_router_score_function="sigmoid",
            moe_router_enable_expert_bias=True,
            moe_router_bias_update_rate=0.0,
            # top-k weights normalised to sum 1, then scaled (HF deepseek_v3 with norm_topk_prob)
            moe_router_topk_scaling_factor=m.routed_scaling_factor,
        )
        if m.n_group > 1:  # group-limited top-k: the best topk_group of n_group expert groups
            out.update(moe_router_num_groups=m.n_group, moe_router_group_topk=m.topk_group)
    else:
        out.update(moe_router_score_function="softmax", moe_router_pre_softmax=False)
    if t.deepep_max_dispatch_tokens > 0:
        # 0.16.1 has no TransformerConfig field for the per-rank token count: DeepEP sizes its
        # buffers itself; the key switches the flex dispatcher on
        out["moe_flex_dispatcher_backend"] = "deepep"
    return out


def require_deepep(t: TrainerConfig) -> None:
    """Refuse DeepEP (`trainer.deepep_max_dispatch_tokens > 0`) where its `deep_ep` package is not
    installed: megatron-core would fail at the first MoE layer's dispatch, deep inside the run."""
    import importlib.util

    if t.deepep_max_dispatch_tokens > 0 and importlib.util.find_spec("deep_ep") is None:
        raise MegatronConfigError(
            f"trainer.deepep_max_dispatch_tokens={t.deepep_max_dispatch_tokens}: DeepEP (the `deep_ep` package, "
            "a CUDA/NVSHMEM build) is not installed in the trainer's environment. Fix: install DeepEP there, "
            "or trainer.deepep_max_dispatch_tokens=0 (moe_token_dispatcher=alltoall)"
        )


def _dispatcher(t: TrainerConfig, device: str) -> str:
    name = t.moe_token_dispatcher
    if t.deepep_max_dispatch_tokens > 0:
        if device == "cpu":
            raise MegatronConfigError(
                f"trainer.deepep_max_dispatch_tokens={t.deepep_max_dispatch_tokens} on the CPU: DeepEP is a "
                "CUDA/NVSHMEM library. Fix: trainer.deepep_max_dispatch_tokens=0"
            )
        return "flex"
    if name == "flex":
        raise MegatronConfigError(
            "trainer.moe_token_dispatcher=flex with trainer.deepep_max_dispatch_tokens=0: flex is DeepEP's "
            "dispatcher. Fix: set trainer.deepep_max_dispatch_tokens > 0, or moe_token_dispatcher=alltoall"
        )
    if name not in ("alltoall", "allgather"):
        raise MegatronConfigError(
            f"trainer.moe_token_dispatcher={name!r}: expected alltoall, allgather or flex (with DeepEP)"
        )
    # alltoall on the CPU runs through cpu_compat's stream stand-in (its D2H side stream)
    return name


def _recompute(t: TrainerConfig) -> dict[str, Any]:
    r = t.recompute
    granularity = RecomputeGranularity(r.granularity)
    if granularity is RecomputeGranularity.none:
        return {}
    if granularity is RecomputeGranularity.selective:
        # Megatron's selective recompute takes modules, not a method or layer count
        return {"recompute_granularity": "selective"}
    return {
        "recompute_granularity": "full",
        "recompute_method": r.method.value,
        "recompute_num_layers": r.num_layers,
    }


def _apex_wgrad_fusion_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is not None


def _dtypes(t: TrainerConfig, device: str) -> dict[str, Any]:
    bf16 = ComputeDtype(t.compute_dtype) is ComputeDtype.bf16
    return {
        "bf16": bf16,
        # CPU: fp32 parameters (the worker's mixed-precision wrapper casts the compute); GPU: bf16
        "params_dtype": torch.bfloat16 if bf16 and device == "cuda" else torch.float32,
        # the activations pipeline stages send each other
        "pipeline_dtype": torch.bfloat16 if bf16 else torch.float32,
        "use_cpu_initialization": device == "cpu",
    }


def _fp8(p: PrecisionConfig, device: str) -> dict[str, Any]:
    precision = Precision(p.name)
    if precision not in (Precision.fp8_blockwise, Precision.mxfp8):
        return {}
    if device == "cpu":
        raise MegatronConfigError(
            f"precision={precision.value} with trainer=megatron on the CPU: Megatron's FP8 runs through "
            "Transformer Engine, which needs a GPU (without TE megatron-core silently runs bf16). "
            "Fix: precision=bf16 or int4_qat on the CPU, or a GPU topology"
        )
    if precision is Precision.fp8_blockwise:
        if tuple(p.block_size) != TE_FP8_BLOCK or p.activation_tile != TE_FP8_ACTIVATION_TILE:
            raise MegatronConfigError(
                f"precision.block_size={list(p.block_size)}, activation_tile={p.activation_tile}: TE's "
                f"Float8BlockScaling is fixed at {list(TE_FP8_BLOCK)} weight blocks and 1 x "
                f"{TE_FP8_ACTIVATION_TILE} activation tiles. Fix: those values"
            )
        scope, recipe = QuantScope(p.fp8_targets), "blockwise"
    else:
        scope, recipe = QuantScope(p.mxfp8_targets), "mxfp8"
    if p.persistent_fp8_params and (precision is Precision.mxfp8 or scope is QuantScope.routed_experts):
        raise MegatronConfigError(
            f"precision.persistent_fp8_params=true with precision={precision.value}, targets={scope.value}: "
            "Megatron's fp8_param makes every TE weight FP8, so skyq keeps it for blockwise on all linears. "
            "Fix: persistent_fp8_params=false, or fp8_blockwise with fp8_targets=all_linear"
        )
    if scope is QuantScope.all_linear:
        return {"fp8": "e4m3", "fp8_recipe": recipe, "fp8_param": p.persistent_fp8_params}
    # routed experts only: the recipe is global (so TEGroupedMLP pads each expert's tokens to the
    # FP8 GEMM's row multiple, which 0.16.1 does only when config.fp8 is set) and every other TE
    # linear is forced back to bf16 by a per-module recipe
    return {"fp8": "e4m3", "fp8_recipe": recipe, "quant_recipe": routed_experts_only_recipe()}


def routed_experts_only_recipe() -> Any:
    """A per-module `RecipeConfig` keeping every TE linear but the routed experts' out of FP8: the
    experts (`ROUTED_EXPERTS_PATTERN`, matched first) run under the global recipe untouched, any
    other module with a quantization hook opens `fp8_autocast(enabled=False)`."""
    from megatron.core.quantization.quant_config import RecipeConfig

    def te_params(**training_recipe: Any) -> dict[str, Any]:
        return {"transformer_engine_config_type": "TEQuantizationParams", "training_recipe": training_recipe}

    return RecipeConfig.from_config_dict(
        {
            "configs": {
                # inside the global FP8 autocast and told not to override it: the global recipe
                "global_recipe": te_params(override_quantized_autocast=False),
                # no FP8 recipe and told to override: fp8_autocast(enabled=False), i.e. bf16
                "bf16": te_params(override_quantized_autocast=True),
            },
            "matchers": {
                "routed_experts": {
                    "type": "glob",
                    "pattern": ROUTED_EXPERTS_PATTERN,
                    "config": "global_recipe",
                    "enabled": True,
                },
                "everything_else": {"type": "glob", "pattern": "*", "config": "bf16", "enabled": True},
            },
        }
    )
