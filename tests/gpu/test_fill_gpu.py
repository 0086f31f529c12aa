"""A weight sync filled in place on the GPU (the grouped Triton quantizers writing straight into the
bucket bytes, `skyq.sync.fill`): the same bucket bytes as serializing and packing, and a repeat
sync commits the per-tensor wire, for every format."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.sync import test_fill

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or importlib.util.find_spec("triton") is None,
        reason="needs CUDA and Triton",
    ),
]


@pytest.mark.parametrize("fmt", test_fill.FORMATS)
def test_filled_buckets_equal_packed_buckets_on_the_gpu(gen, fmt):
    test_fill.test_filled_buckets_equal_packed_buckets_byte_for_byte_padding_included(gen, fmt, device="cuda")


@pytest.mark.parametrize("fmt", test_fill.FORMATS)
def test_a_repeat_sync_on_the_gpu_commits_the_per_tensor_wire(gen, fmt):
    pair = test_fill.Pair(fmt, bucket_bytes=9000)
    first, errors = pair.sync(test_fill.trainer_items(pair.plan, gen, device="cuda"), 1)
    assert not errors and not first.in_place
    items = test_fill.trainer_items(pair.plan, gen, device="cuda")
    stats, errors = pair.sync(items, 2)
    assert not errors and stats.in_place
    assert pair.engine.snapshot() == (2, test_fill.per_tensor_wire(pair.serialize, items))


@pytest.mark.parametrize("fmt", ["fp8_blockwise", "mxfp8", "int4_qat"])
def test_a_non_finite_expert_on_the_gpu_is_refused_by_name(gen, fmt):
    """The grouped quantizers' per-tensor flags (the in-place fill) name the expert, nothing is sent."""
    pair = test_fill.Pair(fmt, bucket_bytes=9000)
    assert not pair.sync(test_fill.trainer_items(pair.plan, gen, device="cuda"), 1)[1]
    items = test_fill.trainer_items(pair.plan, gen, device="cuda")
    k = next(i for i, (name, _) in enumerate(items) if not isinstance(name, str))
    names, stack = items[k]
    stack[4, 0, 1] = float("nan")
    with pytest.raises(test_fill.SyncRefused, match=rf"refused before sending anything.*{names[4]}"):
        pair.sync(items, 2)
    assert pair.engine.version == 1
