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
        role = self._stack_role(key)
        if role is None or stack.ndim != 3:
            return None
        return self.strategy.serialize_stack_tensors(key, stack, role=role)

    def _stack_role(self, key: tuple[str, ...]) -> Role | None:
        if key not in self._stack_roles:  # a trainer sends the same stacks every sync
            roles = {self.plan[name].role for name in key}
            self._stack_roles[key] = roles.pop() if len(roles) == 1 else None
        return self._stack_roles[key]

    def serialize_many(
        self, items: Sequence[tuple[str | tuple[str, ...], Tensor]]
    ) -> list[dict[str, Tensor] | list[tuple[tuple[str, ...], Tensor]] | None]:
        """Per item, `self(name, tensor)` for a name and `serialize_stack_tensors(names, stack)` for
        a tuple of names (None: serialize that stack member by member), with the quantizer calls of
        all items batched by the strategy (`QuantizationStrategy.serialize_many`)."""
        out: list = [None] * len(items)
        where, entries = self._entries(items)
        for i, wire in zip(where, self.strategy.serialize_many(entries)):
            out[i] = wire
        return out

    def serialize_many_into(
        self,
        items: Sequence[tuple[str | tuple[str, ...], Tensor]],
        outs: Sequence[Sequence[tuple[int, int, tuple[Tensor, ...]]]],
    ) -> list[bool]:
        """`serialize_many` written into `outs` where the strategy can
        (`QuantizationStrategy.serialize_many_into`); per item whether it was written."""
        if len(outs) != len(items):
            raise ValueError(f"{len(outs)} destinations for {len(items)} items")
        done = [False] * len(items)
        where, entries = self._entries(items)
        dests = [outs[i] for i in where]
        for i, ok in zip(where, self.strategy.serialize_many_into(entries, dests) if entries else []):
            done[i] = ok
        return done

    def _entries(
        self, items: Sequence[tuple[str | tuple[str, ...], Tensor]]
    ) -> tuple[list[int], list[tuple[str | tuple[str, ...], Tensor, Role]]]:
        """(the indices of the items the strategy takes, those items with their plan role): every
        named tensor, and every [E, N, K] stack whose members share one role."""
        where, entries = [], []
        for i, (name, t) in enumerate(items):
            role = self.plan[name].role if isinstance(name, str) else self._stack_role(name)
            if role is not None and (isinstance(name, str) or t.ndim == 3):
                where.append(i)
                entries.append((name, t, role))
        return where, entries


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
