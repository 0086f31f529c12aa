"""skyq's fused `silu(gate) * up` on a GPU (`skyq.ops.swiglu`): torch's CUDA ops bit for bit (silu with
libdevice's expf and a correctly rounded division, each result rounded as torch rounds it), on the
strided halves of a stacked gate+up output, and replayable from a CUDA graph."""

from __future__ import annotations

import pytest
import torch

from skyq.ops.swiglu import silu_mul, silu_mul_reference
from tests.ops.test_swiglu import check_kernel, stacked_halves

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_kernel_equals_torch_bit_for_bit(gen):
    assert check_kernel(gen, "cuda", exact=True) == []


def test_replays_from_a_cuda_graph(gen):
    gate, up = stacked_halves(gen, 64, 768, torch.bfloat16, "cuda")
    silu_mul(gate, up)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = silu_mul(gate, up)
    g2, u2 = stacked_halves(gen, 64, 768, torch.bfloat16, "cuda")
    gate.copy_(g2)
    up.copy_(u2)
    graph.replay()
    assert torch.equal(out, silu_mul_reference(gate, up))
