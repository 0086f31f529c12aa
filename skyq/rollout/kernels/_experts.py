"""The routed-experts bookkeeping the engine's grouped decode linears share: checking the offsets
that split a [T, K] input sorted by expert, and the per-expert form a grouped linear falls back to
when its kernel does not take the call."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from skyq.quant.errors import QuantizationError


def check_offsets(offsets: Tensor, n_experts: int, what: str) -> None:
    """offsets int32 [E + 1] (expert e's rows offsets[e]:offsets[e + 1])."""
    if not (
        isinstance(offsets, Tensor)
        and offsets.dtype == torch.int32
        and tuple(offsets.shape) == (n_experts + 1,)
    ):
        raise QuantizationError(
            f"{what}: offsets must be int32 [{n_experts + 1}] (expert e's rows offsets[e]:offsets[e + 1]), "
            f"got {getattr(offsets, 'dtype', None)} {tuple(getattr(offsets, 'shape', ()))}"
        )


def offset_bounds(offsets: Tensor, rows: int, what: str) -> list[int]:
    """The offsets on the host (one sync), checked to rise from 0 to `rows`."""
    bounds = offsets.tolist()
    if bounds[0] != 0 or bounds[-1] != rows or any(b > a for a, b in zip(bounds[1:], bounds)):
        raise QuantizationError(f"{what}: offsets {bounds} must rise from 0 to the {rows} routed rows")
    return bounds


def each_expert(
    x: Tensor, offsets: Tensor, n: int, what: str, linear: Callable[[int, Tensor], Tensor]
) -> Tensor:
    """A grouped linear's per-expert form: the offsets checked on the host (`offset_bounds`), then rows
    a:b of the [T, n] output are `linear(e, x[a:b])` for each expert e with rows."""
    bounds = offset_bounds(offsets, x.shape[0], what)
    out = x.new_empty((x.shape[0], n))
    for e, (a, b) in enumerate(zip(bounds, bounds[1:])):
        if b > a:
            out[a:b] = linear(e, x[a:b])
    return out
