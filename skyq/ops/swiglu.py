"""The gated MLP's `silu(gate) * up` in one launch on CUDA.

transformers' experts compute `act_fn(gate) * up`: two kernels (the activation, then the product),
each a pass over the rows, 8 launches a decode step of a 4-layer MoE, launch-bound at decode sizes
(`benchmarks/engine_decode.py --profile`; docs/benchmarks.md). `silu_mul` is one
Triton launch on CUDA with torch's arithmetic: silu in fp32 as torch's CUDA kernel computes it
(`x / (1 + expf(-x))`: libdevice's expf and a correctly rounded division), rounded to the input's
dtype, then the product in fp32 rounded again; elsewhere, and where the kernel does not apply, the
torch expression itself. The engine's grouped decode path calls it; its rows are scored again by the
prefill path (transformers' own ops), so no train/rollout agreement rests on its bits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from skyq.ops import FLOAT_DTYPES
from skyq.quant.kernels import dispatch


def is_silu(act_fn) -> bool:
    """Whether `act_fn` is SiLU: torch's function or module, or transformers' `SiLUActivation`."""
    return act_fn is F.silu or isinstance(act_fn, torch.nn.SiLU) or type(act_fn).__name__ == "SiLUActivation"


def silu_mul_reference(gate: Tensor, up: Tensor) -> Tensor:
    return F.silu(gate) * up


def _kernel_applies(gate: Tensor, up: Tensor) -> bool:
    return (
        dispatch.uses_kernel(gate) and gate.dtype in FLOAT_DTYPES and up.dtype == gate.dtype
        and up.device == gate.device and gate.ndim == up.ndim == 2 and gate.shape == up.shape
        and gate.stride(-1) == up.stride(-1) == 1 and gate.numel() > 0
        and not (torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad))
    )  # fmt: skip


def silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    """`F.silu(gate) * up` for gate, up [R, I] of one dtype (rows of any stride, e.g. the two halves
    of a stacked gate+up output): one Triton launch on CUDA, the torch expression elsewhere and
    with autograd recording."""
    if not _kernel_applies(gate, up):
        return silu_mul_reference(gate, up)
    from skyq.ops import triton_swiglu

    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    triton_swiglu.launch(gate, up, out)
    return out
