"""skyq's rotary kernel on a GPU (`skyq.ops.rotary`): equal to transformers' function bit for bit,
laid out as it lays its results out, and replayable from a CUDA graph."""

from __future__ import annotations

import pytest
import torch

from skyq.ops import rotary
from tests.ops.test_rotary import attention_inputs, check_rotary

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_kernel_equals_the_stock_function_bit_for_bit(gen):
    assert check_rotary(gen, "cuda") == []


def test_replays_from_a_cuda_graph(gen):
    rotary.install()
    q, k, cos, sin = attention_inputs(gen, 4, 1, 16, 4, 128, torch.bfloat16, "cuda")
    rotary.apply_rotary_pos_emb(q, k, cos, sin)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        qo, ko = rotary.apply_rotary_pos_emb(q, k, cos, sin)
    q2, k2, cos2, sin2 = attention_inputs(gen, 4, 1, 16, 4, 128, torch.bfloat16, "cuda")
    for dst, src in ((q, q2), (k, k2), (cos, cos2), (sin, sin2)):
        dst.copy_(src)
    graph.replay()
    want = rotary._reference(q, k, cos, sin, 1)
    assert torch.equal(qo, want[0]) and torch.equal(ko, want[1])
