"""skyq's RMSNorm kernel on a GPU (`skyq.ops.rmsnorm`): its value against the formula in float64,
batch invariance (a row's bits do not depend on the rows beside it or on its position), the
gradient, and a CUDA graph replay. tests/launch/test_local_pair_gpu.py checks that the trainer and
the engine, both carrying it, score the same bits."""

from __future__ import annotations

import pytest
import torch

from skyq.ops.rmsnorm import RMSNorm, _rms_norm_backward_reference, rms_norm, rms_norm_reference
from tests.ops.test_rmsnorm import check_backward, check_kernel

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("shape", [(1, 128), (4096, 128), (2, 16, 3, 128), (1, 1024), (333, 1024), (7, 2048),
                                   (3, 7168), (5, 100), (64, 5000)])  # fmt: skip
@pytest.mark.parametrize("dtypes", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32),
                                    (torch.bfloat16, torch.float32)])  # fmt: skip
def test_kernel_matches_the_formula_and_is_batch_invariant(gen, shape, dtypes):
    x_dtype, w_dtype = dtypes
    x = torch.randn(shape, generator=gen) * 10.0 ** torch.randint(-3, 3, (*shape[:-1], 1), generator=gen)
    weight = torch.randn(shape[-1], generator=gen) * 0.5 + 1.0
    assert check_kernel(x.to(x_dtype).cuda(), weight.to(w_dtype).cuda()) == []


def test_a_row_gets_the_same_bits_in_any_batch_at_any_position(gen):
    n = 1024
    row = (torch.randn(1, n, generator=gen) * 3).to(torch.bfloat16).cuda()
    weight = (torch.randn(n, generator=gen) + 1).to(torch.bfloat16).cuda()
    alone = rms_norm(row, weight, 1e-6)
    for rows, at in [(2, 1), (5, 3), (64, 17), (1000, 999), (4097, 2048)]:
        batch = (torch.randn(rows, n, generator=gen) * 3).to(torch.bfloat16).cuda()
        batch[at] = row[0]
        assert torch.equal(rms_norm(batch, weight, 1e-6)[at], alone[0]), (rows, at)


def test_gradient_is_the_formulas_and_the_module_runs_the_kernel(gen):
    x = (torch.randn(6, 33, 256, generator=gen) * 2).to(torch.bfloat16).cuda().requires_grad_()
    weight = torch.nn.Parameter((torch.randn(256, generator=gen) + 1).cuda())
    dy = torch.randn(6, 33, 256, generator=gen).to(torch.float32).cuda()
    norm = RMSNorm(weight, 1e-6)
    y = norm(x)
    assert y.grad_fn is not None and "RMSNormFn" in type(y.grad_fn).__name__
    dx, dw = torch.autograd.grad(y, (x, weight), dy)
    rdx, rdw = _rms_norm_backward_reference(x, weight, dy, 1e-6, True, True)
    alone = torch.autograd.grad(rms_norm(x, weight.detach(), 1e-6), (x,), dy)[0]  # no dw to compute
    assert torch.equal(alone, dx)
    assert (dx.float() - rdx.float()).abs().max() <= 8 * torch.finfo(
        torch.bfloat16
    ).eps * rdx.float().abs().max()
    assert (dw - rdw).abs().max() <= 1e-5 * rdw.abs().max()
    ref = rms_norm_reference(x, weight, 1e-6)
    assert (y.float() - ref.float()).abs().max() <= 2 * torch.finfo(
        torch.bfloat16
    ).eps * ref.float().abs().max()


@pytest.mark.parametrize("shape", [(1, 128), (3584, 128), (2, 16, 3, 128), (333, 1024), (7, 2048), (5, 100),
                                   (64, 5000), (1792, 1024)])  # fmt: skip
@pytest.mark.parametrize("dtypes", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32),
                                    (torch.bfloat16, torch.float32)])  # fmt: skip
def test_backward_kernel_is_the_formulas_gradient(gen, shape, dtypes):
    x_dtype, w_dtype = dtypes
    x = torch.randn(shape, generator=gen) * 10.0 ** torch.randint(-3, 3, (*shape[:-1], 1), generator=gen)
    weight = torch.randn(shape[-1], generator=gen).to(w_dtype).cuda()
    dy = torch.randn(shape, generator=gen).to(torch.promote_types(x_dtype, w_dtype)).cuda()
    assert check_backward(x.to(x_dtype).cuda(), weight, dy) == []


def test_replays_from_a_cuda_graph(gen):
    x = torch.randn(8, 1024, generator=gen).to(torch.bfloat16).cuda()
    weight = (torch.randn(1024, generator=gen) + 1).to(torch.bfloat16).cuda()
    want = rms_norm(x, weight, 1e-6)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = rms_norm(x, weight, 1e-6)
    x.copy_(torch.randn(8, 1024, generator=gen).to(torch.bfloat16).cuda())
    graph.replay()
    assert torch.equal(out, rms_norm(x, weight, 1e-6)) and not torch.equal(out, want)
