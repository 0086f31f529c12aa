"""Buckets with value spans for the scan tests (CPU and GPU): random bytes laid out as a sync lays
them (16-byte aligned tensors, zero padding), and the exact value check they must pass or fail."""

from __future__ import annotations

import torch

from skyq.sync.byte_runs import aligned
from skyq.sync.values import Span

SPAN_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.float8_e4m3fn)
UNCHECKED = (torch.uint8, torch.int32)


def random_bucket(gen: torch.Generator, sizes: list[int]) -> tuple[torch.Tensor, list[Span]]:
    """A flat uint8 bucket of tensors with `sizes[i]` elements each (dtypes drawn in turn from the
    checked and unchecked ones), finite values in the float spans, and its spans (one per checked
    tensor; `scan.ScanPlan` merges nothing, so neighbours of one dtype stay separate spans)."""
    parts, spans, offset, end = [], [], 0, 0
    dtypes = SPAN_DTYPES + UNCHECKED
    for n in sizes:
        dtype = dtypes[int(torch.randint(0, len(dtypes), (1,), generator=gen))]
        if dtype.is_floating_point:  # finite in every dtype: e4m3 has no inf, a cast past 448 is NaN
            t = (torch.randn(n, generator=gen, dtype=torch.float64) * 100).clamp(-448, 448).to(dtype)
        else:
            t = torch.randint(0, 256, (n * dtype.itemsize,), generator=gen, dtype=torch.uint8)
        raw = t.view(torch.uint8).reshape(-1)
        start = offset
        offset, end = start + aligned(raw.numel()), start + raw.numel()
        parts.append(torch.cat([raw, torch.zeros(offset - start - raw.numel(), dtype=torch.uint8)]))
        if dtype in SPAN_DTYPES and raw.numel():
            spans.append(Span(start, start + raw.numel(), dtype))
    # The last tensor's padding is left off: a bucket's length need not be a multiple of 16.
    bucket = torch.cat(parts)[:end] if parts else torch.zeros(0, dtype=torch.uint8)
    return bucket.clone(), spans


def poison(bucket: torch.Tensor, span: Span, gen: torch.Generator, what: str) -> None:
    """Write one bad value (`nan`, `inf`, or for e4m3 the NaN code 0x7F / 0xFF) into the span."""
    n = (span.end - span.start) // span.dtype.itemsize
    i = int(torch.randint(0, n, (1,), generator=gen))
    values = bucket[span.start : span.end].view(span.dtype)
    if span.dtype == torch.float8_e4m3fn:
        values.view(torch.uint8)[i] = 0x7F if what == "nan" else 0xFF
    else:
        values[i] = float(what)
