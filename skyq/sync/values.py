"""Checks of received values: no non-finite float, no NaN-coded e4m3 byte (bad at the source).

The fast test reads whole byte spans of a bucket (`Span`: back-to-back entries of one checked
dtype, zero padding included, which is finite and no NaN code) with a few device-side reductions
and one host read per sync. It can only raise false alarms (a float sum that overflowed), which the
exact per-tensor checks then clear or turn into an error naming the tensor.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from skyq.quant.errors import QuantizationError, check_finite, check_no_e4m3_nan
from skyq.sync.byte_runs import Run
from skyq.sync.errors import SyncRefused
from skyq.sync.wire_dtypes import view_bytes

FLOATS = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
CHECKED = (*FLOATS, torch.float8_e4m3fn)
SPAN_BYTES = 256 * 1024 * 1024
"""A span is at most this many bytes (or one run, if larger), bounding the float32 sum's terms."""


class Span(NamedTuple):
    """Bytes [start, end) of a bucket that hold only `dtype` values (and zero padding)."""

    start: int
    end: int
    dtype: torch.dtype


def find_spans(runs: Sequence[Run]) -> tuple[Span, ...]:
    """Merge the runs (in byte order) of one checked dtype that follow each other (nothing but
    padding between them) into spans."""
    spans: list[Span] = []
    open_span = False  # the last span may still grow: no run of another dtype came after it
    for run in runs:
        if run.nbytes == 0:
            continue
        if run.dtype not in CHECKED:
            open_span = False
            continue
        end = run.end
        last = spans[-1] if spans else None
        if open_span and last is not None and last.dtype == run.dtype and end - last.start <= SPAN_BYTES:
            spans[-1] = last._replace(end=end)
        else:
            spans.append(Span(run.offset, end, run.dtype))
            open_span = True
    return tuple(spans)


def _bad(flat: Tensor, dtype: torch.dtype) -> Tensor:
    if dtype == torch.float8_e4m3fn:
        # The NaN codes are 0xFF (the largest byte) and 0x7F (the largest int8): two max reductions
        # read the bytes twice and write nothing, where masking and comparing wrote them twice more.
        codes = flat.view(torch.uint8)
        return (codes.amax() == 0xFF) | (codes.view(torch.int8).amax() == 0x7F)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    return torch.isfinite(flat.sum(dtype=acc)).logical_not()


def span_flags(frames: Sequence[Tensor], spans: Sequence[Sequence[Span]]) -> Tensor | None:
    """One bool per span of every frame, True where the span holds a non-finite float sum or an
    e4m3 NaN code, on the first frame's device and not read (None when there is no span): device
    work only, so the caller can read it together with other device values."""
    flags: list[Tensor] = []
    for frame, bucket_spans in zip(frames, spans):
        for start, end, dtype in bucket_spans:
            raw = frame[start:end]
            values = (
                raw
                if dtype == torch.float8_e4m3fn
                else view_bytes(raw, dtype, (raw.numel() // dtype.itemsize,))
            )
            flags.append(_bad(values, dtype).reshape(1).to(frames[0].device))
    return torch.cat(flags) if flags else None


def spans_look_valid(frames: Sequence[Tensor], spans: Sequence[Sequence[Span]]) -> bool:
    """True when no span of any frame holds a non-finite float sum or an e4m3 NaN code."""
    flags = span_flags(frames, spans)
    return flags is None or not bool(flags.any())


def check_received_values(wire: dict[str, Tensor]) -> None:
    """Refuse non-finite floats and NaN-coded e4m3 bytes, naming the first bad tensor."""
    try:
        for name, t in wire.items():
            if t.dtype in FLOATS:
                check_finite(t, name)
            elif t.dtype == torch.float8_e4m3fn:
                check_no_e4m3_nan(t, name)
    except QuantizationError as exc:
        raise SyncRefused(f"received weights are unusable: {exc}") from exc
