"""Dtype names for manifests, and raw-byte views of tensors.

FP8 and E8M0 tensors cannot be pickled in torch 2.13 and gloo refuses them (`Invalid scalar type`),
so every tensor crosses a process boundary as its uint8 bytes; the dtype is restored from its name in
the manifest. Only the dtypes below can appear in a manifest: a name outside this table is refused
instead of being looked up with getattr.
"""

from __future__ import annotations

import torch
from torch import Tensor

from skyq.sync.errors import SyncRefused

WIRE_DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "float64": torch.float64,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "float8_e8m0fnu": torch.float8_e8m0fnu,
    "uint8": torch.uint8,
    "int8": torch.int8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "bool": torch.bool,
}
_NAME_OF: dict[torch.dtype, str] = {dtype: name for name, dtype in WIRE_DTYPES.items()}
_SIZES: dict[torch.dtype, int] = {
    dtype: torch.empty((), dtype=dtype).element_size() for dtype in WIRE_DTYPES.values()
}


def dtype_name(dtype: torch.dtype) -> str:
    """The manifest name of `dtype` (e.g. `float8_e4m3fn`); refuses dtypes the wire cannot carry."""
    if dtype not in _NAME_OF:
        raise SyncRefused(
            f"dtype {dtype} cannot cross the weight-sync wire (supported: {', '.join(WIRE_DTYPES)})"
        )
    return _NAME_OF[dtype]


def dtype_from_name(name: str) -> torch.dtype:
    """The torch dtype a manifest names; an unknown name is refused."""
    if name not in WIRE_DTYPES:
        raise SyncRefused(
            f"manifest names dtype {name!r}, which is not a wire dtype ({', '.join(WIRE_DTYPES)})"
        )
    return WIRE_DTYPES[name]


def as_bytes(t: Tensor) -> Tensor:
    """A flat uint8 view of the bytes of `t` (contiguous copy first when `t` is a strided view)."""
    flat = t.detach().contiguous().reshape(-1)
    if flat.dtype == torch.bool:
        # bool has no `.view(uint8)` guarantee across torch versions; its storage is one byte per value.
        return flat.to(torch.uint8)
    return flat.view(torch.uint8)


def from_bytes(raw: Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> Tensor:
    """Rebuild a tensor of `dtype` and `shape` from its uint8 bytes (a fresh copy, never a view)."""
    if dtype == torch.bool:
        return raw.clone().to(torch.bool).reshape(shape)
    return raw.clone().view(dtype).reshape(shape)


def view_bytes(raw: Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> Tensor:
    """`raw` (uint8 bytes) seen as a tensor of `dtype` and `shape`: a view when the bytes are
    aligned for `dtype`, else (and for bool) a copy, as `from_bytes` makes."""
    size = torch.empty((), dtype=dtype).element_size() if dtype not in _SIZES else _SIZES[dtype]
    if dtype == torch.bool or raw.data_ptr() % size or raw.numel() % size:
        return from_bytes(raw, dtype, shape)
    return raw.view(dtype).reshape(shape)


def nbytes_of(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    """Bytes a tensor of `dtype` and `shape` occupies."""
    numel = 1
    for dim in shape:
        numel *= dim
    return numel * (_SIZES[dtype] if dtype in _SIZES else torch.empty((), dtype=dtype).element_size())
