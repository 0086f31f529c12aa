"""skyq's RMSNorm (`skyq.ops.rmsnorm`), on the CPU.

Off CUDA it is transformers' formula bit for bit, so CPU runs and checkpoints are unchanged; every
model skyq builds (trainer and engine) carries it (tests/ops/test_install.py). The Triton kernel is
checked under the Triton interpreter (where Triton is importable; the set-up installs it) against a
float64 evaluation of the formula and for batch invariance; tests/gpu/test_rmsnorm_gpu.py checks it
on the H200.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRMSNorm

from skyq.ops.rmsnorm import (
    RMSNorm,
    _rms_norm_backward_reference,
    _RMSNormFn,
    rms_norm,
    rms_norm_reference,
)
from tests.interpreter_run import kernels_on_cpu, report, run_under_interpreter, seeded_generator

ROOT = Path(__file__).resolve().parents[2]


def _stock(n: int, dtype: torch.dtype, gen: torch.Generator, eps: float = 1e-6) -> Qwen3MoeRMSNorm:
    stock = Qwen3MoeRMSNorm(n, eps=eps)
    with torch.no_grad():
        stock.weight.copy_(torch.randn(n, generator=gen) * 0.5 + 1.0)
    return stock.to(dtype)


@pytest.mark.parametrize("x_dtype,w_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32),
                                             (torch.bfloat16, torch.float32)])  # fmt: skip
def test_off_cuda_rms_norm_is_the_transformers_module_bit_for_bit(x_dtype, w_dtype):
    gen = torch.Generator().manual_seed(1)
    stock = _stock(96, w_dtype, gen)
    x = (torch.randn(3, 5, 96, generator=gen) * 7).to(x_dtype)
    ours = RMSNorm(stock.weight, stock.variance_epsilon)
    want = stock(x)
    got = ours(x)
    assert got.dtype == want.dtype == torch.promote_types(w_dtype, x_dtype)
    assert torch.equal(got, want)
    assert torch.equal(rms_norm(x, stock.weight, stock.variance_epsilon), want)


@pytest.mark.parametrize("need", [(True, True), (True, False), (False, True)])
def test_backward_is_the_gradient_of_the_formula(need):
    gen = torch.Generator().manual_seed(2)
    x0 = torch.randn(4, 64, generator=gen).to(torch.bfloat16)
    w0 = (torch.randn(64, generator=gen) + 1).to(torch.bfloat16)
    dy = torch.randn(4, 64, generator=gen).to(torch.bfloat16)

    def grads(fn):
        x, w = x0.clone().requires_grad_(need[0]), w0.clone().requires_grad_(need[1])
        fn(x, w).backward(dy)
        return x.grad, w.grad

    ours = grads(lambda x, w: _RMSNormFn.apply(x, w, 1e-6, rms_norm_reference, _rms_norm_backward_reference))
    want = grads(lambda x, w: rms_norm_reference(x, w, 1e-6))
    for got, ref, needed in zip(ours, want, need, strict=True):
        assert (got is None) == (not needed)
        assert got is None or torch.equal(got, ref)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_rms_norm_kernel_under_the_triton_interpreter():
    run_under_interpreter(str(Path(__file__)), marker="interpreter: rms_norm matches")


def check_kernel(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> list[str]:
    """The kernel's result against the formula evaluated in float64 with the same two roundings
    (normalized value to x's dtype, product to the output dtype), and row by row alone (batch
    invariance). Used by the interpreter check here and the GPU test."""
    from skyq.ops.rmsnorm import _rms_norm_triton

    failures = []
    got = _rms_norm_triton(x, weight, eps)
    xd = x.double()
    h = (xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype).double()
    want = (weight.double() * h).to(got.dtype)
    # fp32 sums in another order and an approximate rsqrt: the normalized value may round to the
    # neighbouring x-dtype value, so allow one step of the output dtype's precision on top
    tol = 2 * torch.finfo(x.dtype).eps + 2 * torch.finfo(got.dtype).eps
    err = ((got.double() - want.double()).abs() / want.double().abs().clamp_min(1e-30)).max().item()
    if err > tol:
        failures.append(f"{tuple(x.shape)} {x.dtype}: relative error {err:.3g} > {tol:.3g}")
    rows = x.reshape(-1, x.shape[-1])
    flat = got.reshape(-1, x.shape[-1])
    for r in {0, rows.shape[0] // 2, rows.shape[0] - 1}:
        if not torch.equal(_rms_norm_triton(rows[r : r + 1], weight, eps), flat[r : r + 1]):
            failures.append(f"{tuple(x.shape)} {x.dtype}: row {r} alone differs from it in the batch")
    return failures


def check_backward(x: torch.Tensor, weight: torch.Tensor, dy: torch.Tensor, eps: float = 1e-6) -> list[str]:
    """The backward kernel's (dx, dw) against autograd of the formula (`_rms_norm_backward_reference`),
    within a few steps of x's (dx) and the weight's (dw) precision of each row's magnitude (dx) and of
    the summed magnitudes (dw); dx alone when dw is not needed. Used by the interpreter check here and
    the GPU test."""
    from skyq.ops.rmsnorm import _rms_norm_backward_triton

    failures = []
    label = f"{tuple(x.shape)} {x.dtype} w {weight.dtype}"
    rdx, rdw = _rms_norm_backward_reference(x, weight, dy, eps, True, True)
    dx, dw = _rms_norm_backward_triton(x, weight, dy, eps, True, True)
    if dx.dtype != x.dtype or dw.dtype != weight.dtype or dx.shape != x.shape or dw.shape != weight.shape:
        return [f"{label}: dx {dx.dtype} {tuple(dx.shape)}, dw {dw.dtype} {tuple(dw.shape)}"]
    scale = rdx.double().abs().amax(-1, keepdim=True).clamp_min(1e-30)
    err = ((dx.double() - rdx.double()).abs() / scale).max().item()
    if err > 8 * torch.finfo(x.dtype).eps:
        failures.append(f"{label}: dx error {err:.3g} of each row's largest")
    xf = x.double()
    h = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype).double()
    terms = (dy.double() * h).abs().reshape(-1, x.shape[-1])
    # fp32 sums in another order, and a normalized value x r may round to the neighbouring value of
    # x's dtype on one side (r from another sum order and rsqrt): a few such terms a column
    bound = 8 * max(torch.finfo(weight.dtype).eps, torch.finfo(dy.dtype).eps) * terms.sum(0)
    bound += 4 * torch.finfo(x.dtype).eps * terms.amax(0)
    excess = ((dw.double() - rdw.double()).abs() - bound).max().item()
    if excess > 0:
        failures.append(f"{label}: dw error above its bound by {excess:.3g}")
    only_dx, none = _rms_norm_backward_triton(x, weight, dy, eps, True, False)
    if none is not None or not torch.equal(only_dx, dx):
        failures.append(f"{label}: dx without dw differs")
    return failures


def _interpreter_main() -> None:
    kernels_on_cpu()
    gen = seeded_generator()
    failures = []
    for shape, x_dtype, w_dtype in [((1, 128), torch.bfloat16, torch.bfloat16), ((3, 7, 128), torch.bfloat16, torch.bfloat16),
                                    ((5, 1024), torch.bfloat16, torch.bfloat16), ((9, 100), torch.float32, torch.float32),
                                    ((4, 300), torch.bfloat16, torch.float32), ((2, 5000), torch.bfloat16, torch.bfloat16)]:  # fmt: skip
        x = torch.randn(shape, generator=gen) * 10.0 ** torch.randint(-3, 3, (*shape[:-1], 1), generator=gen)
        weight = torch.randn(shape[-1], generator=gen).to(w_dtype)
        failures += check_kernel(x.to(x_dtype), weight)
        # the public function takes the kernel here (dispatch says so) and is a plain tensor op
        if not torch.equal(rms_norm(x.to(x_dtype), weight, 1e-6), rms_norm(x.to(x_dtype), weight, 1e-6)):
            failures.append(f"{shape}: not deterministic")
        dy = torch.randn(shape, generator=gen).to(torch.promote_types(x_dtype, w_dtype))
        failures += check_backward(x.to(x_dtype), weight, dy)
    report("rms_norm", failures)


if __name__ == "__main__" and "--interpret" in sys.argv:
    sys.path.insert(0, str(ROOT))
    _interpreter_main()
