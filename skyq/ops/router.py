"""The MoE router's expert choice (softmax, top-k, renormalization) in one launch on CUDA, in the
trainer and in the engine.

transformers' `Qwen3MoeTopKRouter` computes its logits with one GEMM, then a softmax, a top-k (a
gather and a sort), a sum, a division and a cast: six kernels a layer, a visible share of a small
decode step (docs/benchmarks.md, `benchmarks/engine_decode.py --profile`). `select_experts` is that
choice in one Triton program a token on CUDA and the stock ops elsewhere. Its softmax and sums are
not torch's (another order, another exp), so its bits differ from the stock router's in the last
place and ties may break differently: `install` (skyq.ops) puts `TopKRouter` in every model skyq
builds, trainer and engine alike, and a token's choice does not depend on the tokens beside it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from skyq.ops import FLOAT_DTYPES
from skyq.quant.kernels import dispatch

MAX_EXPERTS = 4096
MAX_TOP_K = 64


def select_experts_reference(logits: Tensor, top_k: int, norm_topk_prob: bool) -> tuple[Tensor, Tensor]:
    """transformers' `Qwen3MoeTopKRouter` after its GEMM: (values in the logits' dtype, indices)."""
    probs = torch.softmax(logits, dtype=torch.float, dim=-1)
    values, indices = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        values = values / values.sum(dim=-1, keepdim=True)
    return values.to(logits.dtype), indices


def _kernel_applies(logits: Tensor, top_k: int) -> bool:
    return (
        dispatch.uses_kernel(logits) and logits.dtype in FLOAT_DTYPES and logits.ndim == 2 and logits.shape[0] > 0
        and 0 < top_k <= min(logits.shape[1], MAX_TOP_K) and logits.shape[1] <= MAX_EXPERTS
    )  # fmt: skip


def _select_triton(logits: Tensor, top_k: int, norm_topk_prob: bool) -> tuple[Tensor, Tensor]:
    from skyq.ops import triton_router

    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    values = torch.empty((logits.shape[0], top_k), dtype=logits.dtype, device=logits.device)
    indices = torch.empty((logits.shape[0], top_k), dtype=torch.int64, device=logits.device)
    triton_router.launch(logits, values, indices, top_k, norm_topk_prob)
    return values, indices


class _SelectFn(torch.autograd.Function):
    """Forward through the kernel; backward through autograd of the reference's values at the
    kernel's indices, recomputed from the saved logits (the gradient of the same function)."""

    @staticmethod
    def forward(ctx, logits: Tensor, top_k: int, norm_topk_prob: bool, forward_impl) -> tuple[Tensor, Tensor]:
        values, indices = forward_impl(logits, top_k, norm_topk_prob)
        ctx.save_for_backward(logits, indices)
        ctx.norm = norm_topk_prob
        ctx.mark_non_differentiable(indices)
        return values, indices

    @staticmethod
    def backward(ctx, d_values: Tensor, _d_indices: Tensor):
        logits, indices = ctx.saved_tensors
        with torch.enable_grad():
            x = logits.detach().requires_grad_()
            values = torch.softmax(x, dtype=torch.float, dim=-1).gather(-1, indices)
            if ctx.norm:
                values = values / values.sum(dim=-1, keepdim=True)
            (grad,) = torch.autograd.grad(values.to(logits.dtype), x, d_values)
        return grad, None, None, None


def select_experts(logits: Tensor, top_k: int, norm_topk_prob: bool) -> tuple[Tensor, Tensor]:
    """(routing weights [T, k] in the logits' dtype, expert indices [T, k] int64) for router
    logits [T, E]: one Triton launch on CUDA (differentiable in the weights), the reference
    elsewhere. No host sync."""
    if not _kernel_applies(logits, top_k):
        return select_experts_reference(logits, top_k, norm_topk_prob)
    if torch.is_grad_enabled() and logits.requires_grad:
        return _SelectFn.apply(logits, top_k, norm_topk_prob, _select_triton)
    return _select_triton(logits, top_k, norm_topk_prob)


class TopKRouter(nn.Module):
    """A drop-in for transformers' `Qwen3MoeTopKRouter` (same parameter, same outputs: logits,
    routing weights, indices) choosing through `select_experts`."""

    def __init__(self, weight: nn.Parameter, top_k: int, norm_topk_prob: bool) -> None:
        super().__init__()
        self.weight = weight
        self.top_k = top_k
        self.num_experts, self.hidden_dim = weight.shape
        self.norm_topk_prob = norm_topk_prob

    def forward(self, hidden_states: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        logits = F.linear(hidden_states.reshape(-1, self.hidden_dim), self.weight)
        values, indices = select_experts(logits, self.top_k, self.norm_topk_prob)
        return logits, values, indices
