"""Rotary position embedding of q and k as transformers' Qwen3-MoE applies it, one launch on CUDA.

`apply_rotary_pos_emb` is ten small kernels a layer in transformers (two products, a negation, a
concatenation and a sum for each of q and k). Here it is one Triton launch on CUDA with the same
roundings (each product and the sum rounded to bf16, as those ops round them), so the result equals
the stock function's bit for bit (tests/gpu) and the trainer and the engine agree whichever of them
runs it; the stock function runs elsewhere, for other dtypes and for any shape the kernel does not
take. (bf16 only: the rounding through bf16's bit pattern keeps the compiler from fusing a product
and the sum into one FMA; in fp32 and fp16 it did, and on the H200 the results differed from
torch's in the last place.) `install` puts it in transformers' Qwen3-MoE modeling module, which its
attention layers call.
"""

from __future__ import annotations

import torch
from torch import Tensor

from skyq.quant.kernels import dispatch

_stock = None  # transformers' function, kept when `install` replaces it


def _kernel_applies(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, unsqueeze_dim: int) -> bool:
    if not (
        dispatch.uses_kernel(q) and unsqueeze_dim == 1 and q.ndim == k.ndim == 4 and cos.ndim == sin.ndim == 3
    ):
        return False
    (b, _, t, d), (kb, _, kt, kd) = q.shape, k.shape
    half = d // 2
    return (
        q.dtype == k.dtype == cos.dtype == sin.dtype == torch.bfloat16
        and (kb, kt, kd) == (b, t, d) and tuple(cos.shape) == tuple(sin.shape)
        and tuple(cos.shape) in ((b, t, d), (1, t, d))
        and cos.stride() == sin.stride() and d % 2 == 0 and half & (half - 1) == 0
        and q.stride(-1) == k.stride(-1) == cos.stride(-1) == 1 and q.numel() > 0 and k.numel() > 0
        and k.device == cos.device == sin.device == q.device
    )  # fmt: skip


def apply_rotary_pos_emb(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, unsqueeze_dim: int = 1):
    """transformers' `apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim)`: one Triton launch for
    q and k on CUDA (outputs laid out as the stock ops lay them out: like their inputs), the stock
    function elsewhere. Not differentiable through the kernel: with autograd recording, the stock
    function runs (the trainer's backward)."""
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, cos, sin))
    if grad or not _kernel_applies(q, k, cos, sin, unsqueeze_dim):
        return _reference(q, k, cos, sin, unsqueeze_dim)
    from skyq.ops import triton_rotary

    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    triton_rotary.launch(q, k, q_out, k_out, cos, sin)
    return q_out, k_out


def _reference(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, unsqueeze_dim: int):
    if _stock is not None:
        return _stock(q, k, cos, sin, unsqueeze_dim)
    from transformers.models.qwen3_moe.modeling_qwen3_moe import apply_rotary_pos_emb as stock

    return stock(q, k, cos, sin, unsqueeze_dim)


def install() -> None:
    """Make transformers' Qwen3-MoE attention call `apply_rotary_pos_emb` (once per process; its
    results equal the stock function's, so every Qwen3-MoE model in the process may use it)."""
    global _stock
    from transformers.models.qwen3_moe import modeling_qwen3_moe as modeling

    if modeling.apply_rotary_pos_emb is not apply_rotary_pos_emb:
        _stock = modeling.apply_rotary_pos_emb
        modeling.apply_rotary_pos_emb = apply_rotary_pos_emb
