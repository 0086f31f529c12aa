"""Stream tensors into the safetensors format without building the file in memory.

`safetensors.torch.save` returns the whole file as one `bytes` (two copies of every output byte,
made while holding the GIL), and `save_file` offers no way to hash what it writes. `chunks` yields
the very bytes `safetensors.torch.save` produces - the same header, the same tensor order - as
views of the tensors' own memory, so a writer can write and hash each piece in one pass, with the
GIL released in `write` and in `hashlib`.

The byte layout is safetensors' (`prepare` in its `tensor.rs`): an 8-byte little-endian header
length, compact JSON (`__metadata__` first, then the tensors in data order) padded with spaces to a
multiple of 8, then the data of the tensors sorted by descending dtype alignment, then by name.
"""

from __future__ import annotations

import json
import struct
import sys
from collections.abc import Iterator

import torch

# safetensors' `Dtype` enum order ("increasing alignment"): data is sorted by descending rank.
_DTYPES: dict[torch.dtype, tuple[int, str]] = {
    torch.bool: (0, "BOOL"),
    torch.uint8: (1, "U8"),
    torch.int8: (2, "I8"),
    torch.float8_e5m2: (3, "F8_E5M2"),
    torch.float8_e4m3fn: (4, "F8_E4M3"),
    torch.int16: (5, "I16"),
    torch.float16: (7, "F16"),
    torch.bfloat16: (8, "BF16"),
    torch.int32: (9, "I32"),
    torch.float32: (11, "F32"),
    torch.float64: (12, "F64"),
    torch.int64: (13, "I64"),
}
_CHUNK_BYTES = 4 << 20  # write and hash in cache-sized pieces: the hash reads what write just read


def supports(tensors: dict[str, torch.Tensor]) -> bool:
    """True when every tensor is a CPU tensor of a dtype whose safetensors rank is known here, on a
    little-endian host (the tensors' bytes are written as they are in memory)."""
    return sys.byteorder == "little" and all(
        t.device.type == "cpu" and t.dtype in _DTYPES for t in tensors.values()
    )


def _as_bytes(t: torch.Tensor) -> memoryview:
    # numpy has no bf16/fp8: a byte view of the tensor is what is written anyway
    return memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())


def chunks(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None) -> Iterator[memoryview | bytes]:
    """The bytes of `safetensors.torch.save(tensors, metadata)`, in order, without copying data."""
    ordered = sorted(tensors.items(), key=lambda item: (-_DTYPES[item[1].dtype][0], item[0]))
    header: dict[str, object] = {} if metadata is None else {"__metadata__": metadata}
    offset = 0
    for name, t in ordered:
        n = t.numel() * t.element_size()
        header[name] = {
            "dtype": _DTYPES[t.dtype][1],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + n],
        }
        offset += n
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    yield struct.pack("<Q", len(text)) + text
    for _, t in ordered:
        data = _as_bytes(t)
        for start in range(0, len(data), _CHUNK_BYTES):
            yield data[start : start + _CHUNK_BYTES]
