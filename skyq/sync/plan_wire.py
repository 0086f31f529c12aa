"""The quantization plan as the sync sees it: what to expect, how to serialize, how to compare.

The sender serializes each tensor with the plan's role for it; the receiver expects exactly the
plan's wire tensors, grouped by source parameter. Both sides build the plan from the same config.
"""

from __future__ import annotations

import hashlib

from torch import Tensor

from skyq.quant.plan import QuantPlan
from skyq.quant.strategies import QuantizationStrategy
from skyq.sync.receiver import ExpectedUnit
from skyq.sync.sender import Serializer
from skyq.sync.wire_dtypes import as_bytes, dtype_name

WireDigest = dict[str, tuple[str, tuple[int, ...], str]]
"""{wire name: (dtype name, shape, sha256 of the bytes)}: compares weights across processes cheaply."""


def expected_units(plan: QuantPlan) -> list[ExpectedUnit]:
    """One expected unit per planned parameter: its wire tensors' shapes and dtypes."""
    return [ExpectedUnit(source=p.name, tensors={w.name: (w.shape, w.dtype) for w in p.wire}) for p in plan]


def plan_serializer(strategy: QuantizationStrategy, plan: QuantPlan) -> Serializer:
    """`strategy.serialize` with each tensor's role taken from the plan."""

    def serialize(name: str, tensor: Tensor) -> dict[str, Tensor]:
        return strategy.serialize(name, tensor, role=plan[name].role)

    return serialize


def wire_digest(wire: dict[str, Tensor]) -> WireDigest:
    """Digest of a wire state dict (bit-level: two equal digests mean bit-identical tensors)."""
    return {
        name: (
            dtype_name(t.dtype),
            tuple(t.shape),
            hashlib.sha256(as_bytes(t).cpu().numpy().data).hexdigest(),
        )
        for name, t in wire.items()
    }
