"""Dtypes of planned tensors by name (`torch.bfloat16`, `str()` of the torch dtype).

The layouts' parameter specs, the strategies' wire specs and the quantization plan hold these
names, not torch dtypes, so the plan of a model is built from its config without importing torch
(a dry run, `skyq.config validate`). Code that handles tensors asks `torch_dtype(name)`; the
specs' and the plan's `.dtype` properties do that for it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

BF16 = "torch.bfloat16"
FP32 = "torch.float32"
FP8_E4M3 = "torch.float8_e4m3fn"
UINT8 = "torch.uint8"
INT32 = "torch.int32"
INT64 = "torch.int64"

ITEMSIZE: dict[str, int] = {
    BF16: 2,
    "torch.float16": 2,
    FP32: 4,
    FP8_E4M3: 1,
    UINT8: 1,
    "torch.int8": 1,
    INT32: 4,
    INT64: 8,
}
"""Bytes per element of every dtype a plan may hold (the plan JSON refuses any other name)."""

_TORCH: dict[str, torch.dtype] = {}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype named `name` (one of `ITEMSIZE`); imports torch on first use."""
    dtype = _TORCH.get(name)
    if dtype is None:
        if name not in ITEMSIZE:
            raise ValueError(f"{name!r} is not a plan dtype; known: {sorted(ITEMSIZE)}")
        import torch

        dtype = _TORCH[name] = getattr(torch, name.removeprefix("torch."))
    return dtype
