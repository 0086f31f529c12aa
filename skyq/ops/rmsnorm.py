"""RMSNorm as transformers' Qwen3-MoE computes it, one launch on CUDA, and the same op in the trainer
and in the engine.

transformers' `Qwen3MoeRMSNorm` is eight small kernels a call (widen, square, mean, add, rsqrt,
multiply, narrow, scale), 17 calls a decode step of a 4-layer model: a third of the engine's graphed
step's launches (benchmarks/engine_decode.py --profile). `rms_norm` is the same formula in one Triton
launch on CUDA and the stock formula elsewhere. Its sum of squares is not torch's (another order),
so on a GPU its bits differ from the stock module's in the last place; `skyq.ops.install` therefore
puts it in every model skyq builds, the trainer's and the engine's, and it is batch-invariant (a row's
result does not depend on the rows beside it, tests/gpu), so the trainer scoring whole sequences and
the engine decoding one token a step get the same bits for the same row.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from skyq.ops import FLOAT_DTYPES
from skyq.quant.kernels import dispatch

MAX_FEATURES = 16384
"""Rows wider than this take the reference (a program holds one whole row in registers; hidden sizes
of the supported models are <= 8192)."""


def rms_norm_reference(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """transformers' `Qwen3MoeRMSNorm.forward`: x normalized in fp32, narrowed to x's dtype, times
    `weight` (the product in the promoted dtype)."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _kernel_applies(x: Tensor, weight: Tensor) -> bool:
    return (
        dispatch.uses_kernel(x) and x.dtype in FLOAT_DTYPES and weight.dtype in FLOAT_DTYPES and weight.device == x.device
        and weight.ndim == 1 and x.shape[-1] == weight.shape[0] <= MAX_FEATURES and x.numel() > 0
    )  # fmt: skip


def _rms_norm_triton(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    from skyq.ops import triton_rmsnorm

    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    triton_rmsnorm.launch(x2, weight.contiguous(), y.view(-1, x.shape[-1]), eps)
    return y


class _RMSNormFn(torch.autograd.Function):
    """Forward through `forward_impl`; backward through `backward_impl(x, weight, dy, eps, need_x,
    need_w)` from the saved input: the gradient of the same function, its bits matching nothing
    (`_rms_norm_backward_reference`, autograd of the formula, or the Triton kernel)."""

    @staticmethod
    def forward(
        ctx, x: Tensor, weight: Tensor, eps: float, forward_impl: Callable, backward_impl: Callable
    ) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        ctx.backward_impl = backward_impl
        return forward_impl(x, weight, eps)

    @staticmethod
    def backward(ctx, dy: Tensor):
        x, weight = ctx.saved_tensors
        need_x, need_w = ctx.needs_input_grad[:2]
        dx, dw = ctx.backward_impl(x, weight, dy, ctx.eps, need_x, need_w)
        return dx, dw, None, None, None


def _rms_norm_backward_reference(
    x: Tensor, weight: Tensor, dy: Tensor, eps: float, need_x: bool, need_w: bool
) -> tuple[Tensor | None, Tensor | None]:
    """(dx, dw) by autograd of `rms_norm_reference` recomputed from x (None where not needed)."""
    with torch.enable_grad():
        xd = x.detach().requires_grad_(need_x)
        wd = weight.detach().requires_grad_(need_w)
        y = rms_norm_reference(xd, wd, eps)
        wanted = [t for t, need in ((xd, need_x), (wd, need_w)) if need]
        grads = iter(torch.autograd.grad(y, wanted, dy))
    return (next(grads) if need_x else None), (next(grads) if need_w else None)


def _rms_norm_backward_triton(
    x: Tensor, weight: Tensor, dy: Tensor, eps: float, need_x: bool, need_w: bool
) -> tuple[Tensor | None, Tensor | None]:
    """The same gradient in one Triton launch (and, for dw, a sum of its per-program fp32 partials):
    on the H200 the autograd recomputation was ~23 launches a call, 34 calls a trainer step of
    small_moe."""
    from skyq.ops import triton_rmsnorm
    from skyq.quant.kernels._common import sm_count

    n = x.shape[-1]
    x2, dy2 = x.reshape(-1, n), dy.reshape(-1, n)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    dy2 = dy2 if dy2.stride(-1) == 1 else dy2.contiguous()
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    partial = triton_rmsnorm.launch_backward(
        x2, weight.contiguous(), dy2, dx.view(-1, n), eps, need_w, programs=4 * sm_count(x.device)
    )
    dw = partial.sum(0).to(weight.dtype) if need_w else None
    return (dx if need_x else None), dw


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """`rms_norm_reference`'s formula: one Triton launch on CUDA (differentiable), the reference
    elsewhere. No host sync, so it can be captured in a CUDA graph."""
    if not _kernel_applies(x, weight):
        return rms_norm_reference(x, weight, eps)
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _RMSNormFn.apply(x, weight, eps, _rms_norm_triton, _rms_norm_backward_triton)
    return _rms_norm_triton(x, weight, eps)


class RMSNorm(nn.Module):
    """A drop-in for transformers' `Qwen3MoeRMSNorm` (same parameter name, shape and epsilon
    attribute, so state dicts and optimizers see no change) computing through `rms_norm`."""

    def __init__(self, weight: nn.Parameter, eps: float) -> None:
        super().__init__()
        self.weight = weight
        self.variance_epsilon = eps

    def forward(self, hidden_states: Tensor) -> Tensor:
        return rms_norm(hidden_states, self.weight, self.variance_epsilon)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"
