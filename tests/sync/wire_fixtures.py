"""Plain-tensor stand-ins for a model and an engine, so the sync is tested without model code.

`fp8_like_serialize` produces the same kinds of wire tensors the strategies do (e4m3 codes with fp32
scales, uint8 E8M0 scales, packed int32 with bf16 scales and an int64 shape, bf16 passthrough); the
values are a simple per-row quantization, not FORMATS.md, because only the bytes' journey matters here.
"""

from __future__ import annotations

import torch
from torch import Tensor

from skyq.sync.receiver import ExpectedUnit


def random_weights(gen: torch.Generator) -> dict[str, Tensor]:
    """A handful of named bf16 tensors of odd shapes, one of each wire kind."""
    shapes = {
        "model.embed_tokens.weight": (11, 8),
        "model.layers.0.self_attn.q_proj.weight": (16, 8),
        "model.layers.0.mlp.experts.0.up_proj.weight": (12, 64),
        "model.layers.0.mlp.experts.1.down_proj.weight": (8, 16),
        "model.norm.weight": (8,),
    }
    return {name: torch.randn(shape, generator=gen).to(torch.bfloat16) for name, shape in shapes.items()}


def fp8_like_serialize(name: str, t: Tensor) -> dict[str, Tensor]:
    """Wire tensors by name pattern: q_proj -> e4m3 + fp32 scale, up_proj -> e4m3 + uint8 scale,
    down_proj -> int32 packed + bf16 scale + int64 shape, anything else -> bf16."""
    base = name.removesuffix(".weight")
    x = t.float()
    if "q_proj" in name or "up_proj" in name:
        amax = x.abs().amax(dim=1, keepdim=True).clamp(min=1e-12)
        codes = (x * (448.0 / amax)).clamp(-448, 448).to(torch.float8_e4m3fn)
        if "q_proj" in name:
            return {f"{base}.weight": codes, f"{base}.weight_scale_inv": amax / 448.0}
        exponent = torch.ceil(torch.log2(amax / 448.0)).clamp(-127, 127).to(torch.int32) + 127
        return {
            f"{base}.weight": codes,
            f"{base}.weight_scale": exponent.to(torch.uint8).expand(-1, 2).contiguous(),
        }
    if "down_proj" in name:
        q = (x.clamp(-7, 7).round().to(torch.int64) + 8).reshape(x.shape[0], -1, 8)
        shifts = torch.arange(8, dtype=torch.int64, device=x.device) * 4
        packed = (q << shifts).sum(dim=-1)
        packed = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
        return {
            f"{base}.weight_packed": packed,
            f"{base}.weight_scale": x.abs().amax(dim=1, keepdim=True).to(torch.bfloat16),
            f"{base}.weight_shape": torch.tensor(list(x.shape), dtype=torch.int64, device=x.device),
        }
    return {name: t.to(torch.bfloat16)}


def serialize_all(weights: dict[str, Tensor]) -> dict[str, dict[str, Tensor]]:
    return {name: fp8_like_serialize(name, t) for name, t in weights.items()}


def expected_units(weights: dict[str, Tensor]) -> list[ExpectedUnit]:
    """What the receiver's plan would say for `weights` under `fp8_like_serialize`."""
    return [
        ExpectedUnit(source=name, tensors={n: (tuple(w.shape), w.dtype) for n, w in wire.items()})
        for name, wire in serialize_all(weights).items()
    ]


class DictEngine:
    """An engine reduced to what a sync touches: a wire state dict and a version, swapped atomically."""

    def __init__(self) -> None:
        self.version = 0
        self.wire: dict[str, Tensor] = {}

    def commit(self, wire: dict[str, Tensor], version: int) -> None:
        self.wire, self.version = dict(wire), version

    def snapshot(self) -> tuple[int, dict[str, bytes]]:
        return self.version, {n: raw_bytes(t) for n, t in self.wire.items()}


def raw_bytes(t: Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).cpu().numpy().tobytes()
