"""Model operations the trainer and the rollout engine both run, so both compute the same bits.

A quantized format's train/rollout agreement (M5) depends on every op before a quantizer giving the
same bits on both sides: an activation one bf16 ulp apart can land on another e4m3 code. So where
skyq replaces a stock transformers op with a faster kernel, it replaces it on BOTH sides with one
function that dispatches on the tensor's device (Triton on CUDA, the stock formula elsewhere), and no
configuration can make the two disagree. Imports torch and `skyq.quant.kernels` only; the Triton
kernel modules are imported where they run.
"""

from __future__ import annotations

import torch
from torch import nn

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
"""The dtypes the ops' kernels take; others run the stock formulas."""


def install(model: nn.Module) -> list[str]:
    """skyq's ops in a transformers Qwen3-MoE model: its RMSNorm modules become `rmsnorm.RMSNorm`,
    its routers `router.TopKRouter` (each keeping its parameter object and name), and the modeling
    module's rotary function `rotary.apply_rotary_pos_emb`, and a model attending with `sdpa` attends
    with `attention.sdpa_attention_forward` (decode without copying the KV cache). Returns the
    replaced module names. Every model skyq builds, the trainer's and the engine's, goes through this."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRMSNorm, Qwen3MoeTopKRouter

    from skyq.ops import attention, rotary
    from skyq.ops.rmsnorm import RMSNorm
    from skyq.ops.router import TopKRouter

    rotary.install()
    attention.install(model)
    replaced = []
    for name, module in list(model.named_modules()):
        if type(module) is Qwen3MoeRMSNorm:
            ours = RMSNorm(module.weight, module.variance_epsilon)
        elif type(module) is Qwen3MoeTopKRouter:
            ours = TopKRouter(module.weight, module.top_k, module.norm_topk_prob)
        else:
            continue
        parent, _, child = name.rpartition(".")
        model.get_submodule(parent).register_module(child, ours)
        replaced.append(name)
    return replaced
