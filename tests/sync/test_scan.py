"""`scan`: the one-pass checksum + value check of a sync's buckets.

On the CPU (CI) this checks the chunk table every end of a sync derives from its layout and the
torch path `PendingScan` takes without CUDA. The Triton kernel is checked against a torch
reference of the same partial sums under the Triton interpreter where Triton is importable
(skipped where Triton is not installed; a subprocess, since TRITON_INTERPRET must be set before
`@triton.jit` runs), and on the GPU in tests/gpu/test_bytescan.py.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

from skyq.sync.byte_runs import ALIGN_BYTES
from skyq.sync.checksums import WSUM64, bucket_checksums
from skyq.sync.errors import SyncError
from skyq.sync.scan import CHUNK_BYTES, WORD_MASKS, PendingScan, ScanPlan
from skyq.sync.values import Span

if __package__:
    from .scan_fixtures import poison, random_bucket
else:  # run as a script by the interpreter test
    sys.path.insert(0, str(Path(__file__).parent))
    from scan_fixtures import poison, random_bucket  # type: ignore[no-redef]

SIZES = [[1], [7, 300, 65_536, 9], [40_000, 3, 17, 70_000], [0, 5], []]


def reference_partials(frame: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """What the kernel writes per chunk row (start, end, word - 1, mask, bucket) of `frame`: the byte
    sum, the sum of byte * (index mod 65521 + 1), and whether a word's most significant byte has all
    mask bits."""
    out = []
    for start, end, wmask, mask, _ in rows.tolist():
        b = frame[start:end].to(torch.int64)
        idx = torch.arange(start, end, dtype=torch.int64)
        msb = ((idx - start) & wmask) == wmask
        bad = bool(mask) and bool((msb & ((b & mask) == mask)).any())
        out.append([int(b.sum()), int((b * (idx % 65521 + 1)).sum()), int(bad)])
    return torch.tensor(out, dtype=torch.int64).reshape(-1, 3)


@pytest.mark.parametrize("sizes", SIZES)
def test_the_chunk_table_tiles_each_bucket_in_aligned_chunks_with_its_spans_masks(gen, sizes):
    bucket, spans = random_bucket(gen, sizes)
    plan = ScanPlan.of([bucket.numel(), 100], [spans, []])
    rows = plan.rows[plan.first[0] : plan.first[0] + plan.counts[0]]
    assert [r[0] for r in rows[1:]] == [r[1] for r in rows[:-1]]  # back to back
    assert (rows[0][0] if rows else 0) == 0 and (rows[-1][1] if rows else 0) == bucket.numel()
    assert all(r[0] % ALIGN_BYTES == 0 and 0 < r[1] - r[0] <= CHUNK_BYTES for r in rows)
    for span in spans:  # every byte of a span lies in a chunk with its dtype's word and mask
        word, mask = WORD_MASKS[span.dtype]
        covering = [r for r in rows if r[0] < span.end and r[1] > span.start]
        assert covering[0][0] <= span.start and covering[-1][1] >= span.end
        assert all(r[2:] == (word - 1, mask, 0) for r in covering)
    for restart in range(65521, bucket.numel(), 65521):  # the wsum64 weights start over near a chunk's start
        assert any(r[0] <= restart < min(r[1], r[0] + 16) for r in rows), restart
    checked = sum(r[1] - r[0] for r in rows if r[3])
    assert checked >= sum(s.end - s.start for s in spans)
    assert plan.counts[1] == 1 and plan.rows[plan.first[1]] == (0, 100, 0, 0, 1)
    table, bucket_of = plan.tables(torch.device("cpu"))
    assert table.shape == (len(plan.rows), 5) and bucket_of.tolist() == [0] * plan.counts[0] + [1]


def test_a_misaligned_span_is_refused_naming_it():
    with pytest.raises(SyncError, match=r"\[8, 24\) is not 16-byte aligned"):
        ScanPlan.of([64], [[Span(8, 24, torch.float32)]])


@pytest.mark.parametrize("sizes", SIZES[:3])
def test_pending_scan_on_the_cpu_gives_the_checksums_and_flags_each_bad_value(gen, sizes):
    frames, spans = zip(*(random_bucket(gen, s) for s in (sizes, [300, 1000])))
    plan = ScanPlan.of([f.numel() for f in frames], spans)
    for algorithms in (None, [WSUM64] * len(frames)):
        got, bad = PendingScan(frames, spans, plan, algorithms).read()
        assert got == bucket_checksums(frames, algorithms) and not bad
    assert PendingScan(frames, spans, plan, checksums=False).read() == ([], False)
    for span in (s for bucket_spans in spans for s in bucket_spans):
        for what in ("nan", "inf"):
            broken = [f.clone() for f in frames]
            frame = next(i for i, s in enumerate(spans) if span in s)
            poison(broken[frame], span, gen, what)
            assert PendingScan(broken, spans, plan).read()[1], (span, what)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton (not installed in CI)")
def test_the_kernel_under_the_triton_interpreter_gives_the_reference_partials():
    from interpreter_run import run_under_interpreter

    run_under_interpreter(__file__)


def _interpreter_check() -> None:
    from skyq.quant.kernels import triton_bytescan

    seed = int.from_bytes(os.urandom(4), "little")
    print(f"seed {seed}")
    gen = torch.Generator().manual_seed(seed)
    layouts = ([7, 300, 17_000, 9], [20_000, 3, 5], [1], [70_000, 40_000])
    frames, spans = zip(*(random_bucket(gen, s) for s in layouts))
    frames = list(frames)
    plan = ScanPlan.of([f.numel() for f in frames], spans)
    assert any(r[0] % 65521 and r[0] // 65521 != (r[0] + 15) // 65521 for r in plan.rows)  # a restart inside
    rows, _ = plan.tables(torch.device("cpu"))

    def check(frames) -> torch.Tensor:
        part = triton_bytescan.launch(frames, rows)
        for frame, first, n in zip(frames, plan.first, plan.counts):
            want = reference_partials(frame, rows[first : first + n])
            assert torch.equal(part[first : first + n], want), (part[first : first + n], want)
        return part

    assert not check(frames)[:, 2].any()
    for b, bucket_spans in enumerate(spans):  # one bad value per span, each dtype's word position
        for span in bucket_spans:
            broken = [f.clone() for f in frames]
            poison(broken[b], span, gen, "nan")
            assert check(broken)[:, 2].any(), span
    print("interpreter check passed")


if __name__ == "__main__" and sys.argv[1:] == ["--interpret"]:
    _interpreter_check()
