"""The grouped experts' routing kernel on a GPU (`skyq.ops.moe_route`): the reference's integers
exactly, up to the kernel's row limit (one launch up to 512 entries, two block-counting ones above), and
replayable from a CUDA graph."""

from __future__ import annotations

import pytest
import torch

from skyq.ops.moe_route import KERNEL_MAX_ENTRIES, route, route_reference
from tests.ops.test_moe_route import CASES, check_route, routing

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize(
    "t,k,experts",
    [*CASES, (KERNEL_MAX_ENTRIES // 8, 8, 256), (1, 8, 384), (64, 8, 256), (256, 4, 32), (1000, 8, 128)],
)
def test_kernel_gives_the_reference_integers(gen, t, k, experts):
    idx = routing(gen, t, k, experts).cuda()
    assert check_route(route(idx, experts), route_reference(idx, experts))


@pytest.mark.parametrize("tokens", [16, 512])  # one launch; the two block-counting launches
def test_replays_from_a_cuda_graph(gen, tokens):
    idx = routing(gen, tokens, 8, 128).cuda()
    route(idx, 128)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = route(idx, 128)
    idx.copy_(routing(gen, tokens, 8, 128).cuda())
    graph.replay()
    assert check_route(got, route_reference(idx, 128))
