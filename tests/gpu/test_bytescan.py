"""The Triton bucket scan on the GPU: the same wsum64 checksums as the torch path, bit for bit, and
a flag for every non-finite float and e4m3 NaN code, on fresh random buckets of odd sizes."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from skyq.sync.checksums import WSUM64, bucket_checksums
from skyq.sync.scan import PendingScan, ScanPlan, scan_kernel_applies
from skyq.sync.values import Span
from tests.sync.scan_fixtures import poison, random_bucket

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or importlib.util.find_spec("triton") is None,
        reason="needs CUDA and Triton",
    ),
]

SIZES = [[1], [7, 300, 65_536, 9], [40_000, 3, 17, 700_000], [5, 1_000_003], [3_000_000, 2]]


def _buckets(gen, sizes_list):
    frames, spans = zip(*(random_bucket(gen, s) for s in sizes_list))
    return [f.cuda() for f in frames], list(spans)


def test_the_kernel_gives_the_torch_checksums_and_no_flag_on_good_values(gen):
    frames, spans = _buckets(gen, SIZES)
    plan = ScanPlan.of([f.numel() for f in frames], spans)
    assert scan_kernel_applies(frames, None)
    got, bad = PendingScan(frames, spans, plan).read()
    assert got == bucket_checksums([f.cpu() for f in frames], [WSUM64] * len(frames))
    assert got == bucket_checksums(frames)  # the torch path on the GPU
    assert not bad


def test_every_bad_value_is_flagged_and_bytes_outside_spans_are_not(gen):
    frames, spans = _buckets(gen, SIZES[1:3])
    plan = ScanPlan.of([f.numel() for f in frames], spans)
    for b, bucket_spans in enumerate(spans):
        for span in bucket_spans:
            for what in ("nan", "inf"):
                broken = [f.clone() for f in frames]
                poison(broken[b], span, gen, what)
                assert PendingScan(broken, spans, plan).read()[1], (span, what)
    # The same bytes where no span says a float lives (an int32 tensor, say) are not values.
    unchecked = [f.clone() for f in frames]
    raw = torch.full((64,), 0x7F, dtype=torch.uint8, device="cuda")
    plan_none = ScanPlan.of([64], [[]])
    assert not PendingScan([raw], [[]], plan_none).read()[1]
    assert not PendingScan(unchecked, spans, plan).read()[1]


def test_large_finite_values_pass_and_the_flag_is_at_most_a_false_alarm_above_2_to_127():
    big = torch.tensor([3.0e38, -1.0e38, 65504.0, 1.0], dtype=torch.float32)
    frame = big.view(torch.uint8).cuda()
    spans = [[Span(0, 16, torch.float32)]]
    plan = ScanPlan.of([16], spans)
    assert PendingScan([frame], spans, plan).read()[1]  # 3e38 > 2^127: flagged, the exact check clears it
    small = torch.tensor([1.0e38, -1.0e38, 65504.0, 1.0], dtype=torch.float32).view(torch.uint8).cuda()
    assert not PendingScan([small], spans, plan).read()[1]
    half = torch.tensor([65504.0, -65504.0, 1.0, 0.0, 2.0, 3.0, 4.0, 5.0], dtype=torch.float16)
    assert not PendingScan(
        [half.view(torch.uint8).cuda()],
        [[Span(0, 16, torch.float16)]],
        ScanPlan.of([16], [[Span(0, 16, torch.float16)]]),
    ).read()[1]
