"""`QuantizationError` and the input checks every quantizer runs before touching data."""

from __future__ import annotations

import torch
from torch import Tensor


class QuantizationError(ValueError):
    """A tensor cannot be quantized or dequantized as asked (non-finite values, impossible shape)."""


_SUMMABLE = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_finite(t: Tensor, name: str) -> None:
    """Raise `QuantizationError` naming `name` and counting NaN/inf if `t` is not all finite.

    Fast path: a sum is NaN or inf whenever an element is, and runs much faster than `isfinite`
    on CPU (docs/benchmarks.md, M6 converters); only a non-finite sum (possibly an overflow of
    finite values) pays for the exact element check."""
    if t.dtype in _SUMMABLE and t.numel() and bool(torch.isfinite(t.sum())):
        return
    if bool(torch.isfinite(t).all()):
        return
    _raise_non_finite(t, name)


def check_finite_reduced(reduced: Tensor, t: Tensor, name: str) -> None:
    """`check_finite(t, name)` for a quantizer that already computed `reduced`, a max (or min) of
    `t` over blocks: a NaN or inf element always makes its block's max non-finite (torch's max
    reductions propagate NaN), so checking the small `reduced` is enough and only the failure path
    reads `t` again to count the bad elements."""
    if not bool(torch.isfinite(reduced).all()):
        _raise_non_finite(t, name)


def _raise_non_finite(t: Tensor, name: str) -> None:
    n_nan = int(torch.isnan(t).sum())
    n_inf = int(torch.isinf(t).sum())
    raise QuantizationError(
        f"{name}: {n_nan} NaN and {n_inf} inf value(s) among {t.numel()} elements "
        f"(shape {tuple(t.shape)}, {t.dtype}); refusing to quantize a non-finite tensor"
    )


def check_float_input(w: Tensor, name: str, *, min_ndim: int = 2) -> None:
    """Refuse a tensor that is not floating point, has too few dims or no elements."""
    if not isinstance(w, Tensor):
        raise QuantizationError(f"{name}: expected a torch.Tensor, got {type(w).__name__}")
    if not w.is_floating_point():
        raise QuantizationError(f"{name}: expected a floating-point tensor, got {w.dtype}")
    if w.ndim < min_ndim:
        raise QuantizationError(
            f"{name}: expected at least {min_ndim} dims ([..., N, K]), got shape {tuple(w.shape)}"
        )
    if w.numel() == 0:
        raise QuantizationError(f"{name}: tensor of shape {tuple(w.shape)} has no elements")


def check_dtype(t: Tensor, dtype: torch.dtype, name: str) -> None:
    """Refuse `t` unless its dtype is `dtype`."""
    if t.dtype != dtype:
        raise QuantizationError(f"{name}: expected dtype {dtype}, got {t.dtype}")


def check_shape(t: Tensor, expected: tuple[int, ...], name: str, how: str) -> None:
    """Refuse `t` unless its shape is `expected`; `how` explains where `expected` comes from."""
    if tuple(t.shape) != tuple(expected):
        raise QuantizationError(f"{name}: expected shape {tuple(expected)} ({how}), got {tuple(t.shape)}")


def check_no_e4m3_nan(q: Tensor, name: str) -> None:
    """Refuse an e4m3 tensor holding NaN codes (0x7F / 0xFF): a corrupt or mis-typed checkpoint."""
    n_nan = int(((q.view(torch.uint8) & 0x7F) == 0x7F).sum())
    if n_nan:
        raise QuantizationError(
            f"{name}: {n_nan} NaN code(s) (0x7F/0xFF) in e4m3 tensor of shape {tuple(q.shape)}"
        )
