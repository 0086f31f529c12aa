"""Routed experts' rows through one GEMM a projection: `torch._grouped_mm` over rows sorted by expert.

The engine's prefill and scoring, its bf16 decode, and the trainer's quantized experts on a GPU all
multiply this way, so trainer and engine run one function on the same operands."""

from __future__ import annotations

import functools

import torch
from torch import Tensor


def bf16_grouped_linear(x: Tensor, w: Tensor, offsets: Tensor) -> Tensor:
    """x [T, K] (rows sorted by expert, expert e's rows offsets[e]:offsets[e + 1]) @ w[e]^T for
    w [E, N, K]: `torch._grouped_mm` (one launch, no host sync; differentiable)."""
    return torch._grouped_mm(x.contiguous(), w.transpose(-2, -1), offs=offsets[1:])


@functools.cache
def bf16_grouped_mm_on(device: torch.device) -> bool:
    """torch._grouped_mm's bf16 CUDA kernel needs compute capability >= 9.0."""
    return hasattr(torch, "_grouped_mm") and torch.cuda.get_device_capability(device) >= (9, 0)
