"""Launch helpers shared by the Triton kernel modules (torch only; no Triton import here)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

FLT_MAX = float(torch.finfo(torch.float32).max)


def as_3d(w: Tensor) -> Tensor:
    """View `w` [..., N, K] as [B, N, K] without copying when the leading dims allow it.

    The kernels take arbitrary strides for the last three dims, so transposed and strided weights
    are read in place; only a >3-D tensor whose leading dims cannot be merged is copied.
    """
    if w.ndim == 2:
        return w.unsqueeze(0)
    if w.ndim == 3:
        return w
    return w.reshape(-1, *w.shape[-2:])


def new_flag(device: torch.device) -> Tensor:
    """One int32 counter the kernels bump when a tile holds an invalid input (NaN/inf, NaN code)."""
    return torch.zeros(1, dtype=torch.int32, device=device)


def raise_if_flagged(flag: Tensor, validate: Callable[[], None]) -> None:
    """Read the kernel's flag (one host sync) and, when set, run the reference's own validation,
    which raises the same `QuantizationError` (same wording) the reference would have."""
    if int(flag.item()):
        validate()
        raise AssertionError("a kernel flagged an invalid input that the reference validation accepted")


def cdiv(a: int, b: int) -> int:
    return -(-a // b)
