"""The router's expert choice on a GPU (`skyq.ops.router`): torch's experts where the probabilities
are distinct, weights within rounding, ties to the lower expert, NaN rows naming real experts, batch
invariance, the gradient, and a CUDA graph replay."""

from __future__ import annotations

import pytest
import torch

from skyq.ops.router import TopKRouter, select_experts, select_experts_reference
from tests.ops.test_router import check_select

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_kernel_chooses_torchs_experts(gen):
    assert check_select(gen, "cuda") == []


def test_router_module_is_differentiable_in_its_weight(gen):
    weight = torch.nn.Parameter(torch.randn(32, 64, generator=gen).cuda())
    x = torch.randn(10, 64, generator=gen).cuda()
    logits, values, indices = TopKRouter(weight, 4, True)(x)
    assert values.grad_fn is not None and not indices.requires_grad
    ref_values, ref_indices = select_experts_reference(logits, 4, True)
    (grad,) = torch.autograd.grad(values.sum() + (values**2).sum(), weight, retain_graph=True)
    assert torch.equal(indices, ref_indices)
    (ref_grad,) = torch.autograd.grad(ref_values.sum() + (ref_values**2).sum(), weight)
    assert torch.allclose(grad, ref_grad, rtol=1e-4, atol=1e-6)


def test_replays_from_a_cuda_graph(gen):
    logits = torch.randn(16, 128, generator=gen).to(torch.bfloat16).cuda()
    select_experts(logits, 8, True)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        values, indices = select_experts(logits, 8, True)
    logits.copy_(torch.randn(16, 128, generator=gen).to(torch.bfloat16).cuda())
    graph.replay()
    want_v, want_i = select_experts(logits.clone(), 8, True)
    assert torch.equal(values, want_v) and torch.equal(indices, want_i)
