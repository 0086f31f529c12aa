"""The quantization plan as the sync sees it: what to expect, how to serialize, how to compare.

The sender serializes each tensor with the plan's role for it; the receiver expects exactly the
plan's wire tensors, grouped by source parameter. Both sides build the plan from the same config.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from torch import Tensor

from skyq.quant.layouts import Role
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


class PlanSerializer:
    """`strategy.serialize` with each tensor's role taken from the plan (a `Serializer`), and
    `serialize_stack` for stacked items: one quantizer call per stack of same-role tensors."""

    def __init__(self, strategy: QuantizationStrategy, plan: QuantPlan) -> None:
        self.strategy = strategy
        self.plan = plan
        self._stack_roles: dict[tuple[str, ...], Role | None] = {}

    def __call__(self, name: str, tensor: Tensor) -> dict[str, Tensor]:
        return self.strategy.serialize(name, tensor, role=self.plan[name].role)

    def serialize_stack(self, names: Sequence[str], stack: Tensor) -> list[dict[str, Tensor]]:
        roles = {self.plan[name].role for name in names}
        if len(roles) != 1 or stack.ndim != 3:
            return [self(name, stack[i]) for i, name in enumerate(names)]
        return self.strategy.serialize_stack(names, stack, role=roles.pop())

    def serialize_stack_tensors(
        self, names: Sequence[str], stack: Tensor
    ) -> list[tuple[tuple[str, ...], Tensor]] | None:
        """`strategy.serialize_stack_tensors` (whole wire tensors) when every member has one role;
        None otherwise (the sender then serializes member by member)."""
        key = tuple(names)
        if key not in self._stack_roles:  # a trainer sends the same stacks every sync
            roles = {self.plan[name].role for name in key}
            self._stack_roles[key] = roles.pop() if len(roles) == 1 else None
        role = self._stack_roles[key]
        if role is None or stack.ndim != 3:
            return None
        return self.strategy.serialize_stack_tensors(key, stack, role=role)


def plan_serializer(strategy: QuantizationStrategy, plan: QuantPlan) -> Serializer:
    """`strategy.serialize` with each tensor's role taken from the plan (batches stacked items)."""
    return PlanSerializer(strategy, plan)


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
