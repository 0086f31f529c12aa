"""Model operations the trainer and the rollout engine both run, so both compute the same bits.

A quantized format's train/rollout agreement (M5) depends on every op before a quantizer giving the
same bits on both sides: an activation one bf16 ulp apart can land on another e4m3 code. So where
skyq replaces a stock transformers op with a faster kernel, it replaces it on BOTH sides with one
function that dispatches on the tensor's device (Triton on CUDA, the stock formula elsewhere), and no
configuration can make the two disagree. Imports torch and `skyq.quant.kernels` only; the Triton
kernel modules are imported where they run.
"""

from __future__ import annotations

from torch import nn


def install(model: nn.Module) -> list[str]:
    """skyq's ops in a transformers Qwen3-MoE model (`rmsnorm.fuse_norms`: its norm modules replaced;
    `rotary.install`: the modeling module's rotary function); returns the replaced module names.
    Every model skyq builds, the trainer's and the engine's, goes through this."""
    from skyq.ops import rmsnorm, rotary

    rotary.install()
    return rmsnorm.fuse_norms(model)
