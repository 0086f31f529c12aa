"""FP8 blockwise linear: every GEMM checked against a float reference, at every shape.

Two references per output: float64 on the *quantized* operands (the recipe's exact value; cuBLAS
must match it to bf16 output rounding, which catches wrong scale layouts, e.g. the unpadded
K = 768 weight scales that silently corrupt the product), and float64 on the unquantized inputs
(FP8's own error, bounded, and compared with bf16's). The `emulated` tests run on the CPU too.
"""

from __future__ import annotations

import pytest
import torch

from skyq.trainer.fp8_linear import (
    FP8BlockwiseLinear,
    blockwise_gemm_supported,
    fp8_blockwise_linear,
    fp8_expert_linear,
)

needs_sm90 = pytest.mark.skipif(
    not torch.cuda.is_available() or not blockwise_gemm_supported(torch.device("cuda")),
    reason="needs an SM90 GPU with blockwise cuBLAS",
)
# (M tokens, N out, K in): Qwen3-30B-A3B expert up/gate (1536x2048) and down (2048x768: K/128 = 6,
# padded to 8), attention q/o, Kimi's 576-wide kv_a (ragged N block), odd token counts, K = 1280.
SHAPES = [
    (256, 768, 512),
    (1000, 2048, 768),
    (77, 1536, 2048),
    (512, 512, 1280),
    (130, 576, 7168),
    (4096, 4096, 2048),
]
EXACT_TOL = 1e-2  # vs float64 on the quantized operands: bf16 output rounding (~2e-3) with margin
FP8_TOL = 8e-2  # vs float64 on the unquantized inputs: e4m3 rounding of both operands (~4e-2)


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.double(), expected.double()
    assert bool(torch.isfinite(actual).all())
    return float((actual - expected).norm() / expected.norm())


def run_fwd_bwd(fn, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, dy: torch.Tensor):
    x = x.detach().clone().requires_grad_()
    w = w.detach().clone().requires_grad_()
    b = None if b is None else b.detach().clone().requires_grad_()
    y = fn(x, w, b)
    y.backward(dy)
    return y.detach(), x.grad, w.grad, None if b is None else b.grad


def make_case(gen: torch.Generator, m: int, n: int, k: int, device: str):
    x = torch.randn(m, k, generator=gen).to(device, torch.bfloat16)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(device, torch.bfloat16)
    b = torch.randn(n, generator=gen).to(device, torch.bfloat16)
    dy = torch.randn(m, n, generator=gen).to(device, torch.bfloat16)
    return x, w, b, dy


def float64_linear(x, w, b):
    return torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_cublas_blockwise_matches_float64_of_the_quantized_operands(gen, m, n, k):
    x, w, b, dy = make_case(gen, m, n, k, "cuda")
    real = run_fwd_bwd(lambda x, w, b: fp8_blockwise_linear(x, w, b, emulate=False), x, w, b, dy)
    emulated = run_fwd_bwd(lambda x, w, b: fp8_blockwise_linear(x, w, b, emulate=True), x, w, b, dy)
    for name, r, e in zip(("y", "dx", "dw", "db"), real, emulated):
        assert rel_err(r, e) < EXACT_TOL, f"{name} at M,N,K = {m},{n},{k}: {rel_err(r, e):.2e}"


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_fp8_linear_error_vs_unquantized_float64_is_bounded(gen, m, n, k):
    x, w, b, dy = make_case(gen, m, n, k, "cuda")
    fp8 = run_fwd_bwd(lambda x, w, b: fp8_blockwise_linear(x, w, b), x, w, b, dy)
    bf16 = run_fwd_bwd(torch.nn.functional.linear, x, w, b, dy)
    exact = run_fwd_bwd(float64_linear, x.double(), w.double(), b.double(), dy.double())
    for name, f, h, e in zip(("y", "dx", "dw", "db"), fp8, bf16, exact):
        err, err_bf16 = rel_err(f, e), rel_err(h, e)
        print(f"{name} M,N,K={m},{n},{k}: fp8 {err:.2e} bf16 {err_bf16:.2e}")
        assert err < FP8_TOL, f"{name}: {err:.2e}"


@pytest.mark.gpu
@needs_sm90
def test_expert_linear_matches_per_expert_float64(gen):
    counts = [0, 37, 256, 5, 0, 300]
    n, k = 1536, 2048
    x = torch.randn(sum(counts), k, generator=gen).to("cuda", torch.bfloat16)
    w = (torch.randn(len(counts), n, k, generator=gen) / k**0.5).to("cuda", torch.bfloat16)
    dy = torch.randn(sum(counts), n, generator=gen).to("cuda", torch.bfloat16)
    results = {}
    for emulate in (False, True):
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = fp8_expert_linear(xr, wr, counts, emulate=emulate)
        y.backward(dy)
        results[emulate] = (y.detach(), xr.grad, wr.grad)
    for name, r, e in zip(("y", "dx", "dw"), results[False], results[True]):
        assert rel_err(r, e) < EXACT_TOL, name
    assert bool((results[False][2][0] == 0).all()) and bool((results[False][2][4] == 0).all())
    starts = [sum(counts[:i]) for i in range(len(counts))]
    for e, (s, c) in enumerate(zip(starts, counts)):
        if c:
            assert rel_err(results[False][0][s : s + c], x[s : s + c].double() @ w[e].double().t()) < FP8_TOL


@pytest.mark.gpu
@needs_sm90
def test_module_requantizes_after_an_optimizer_step(gen):
    layer = FP8BlockwiseLinear.from_linear(torch.nn.Linear(512, 256, device="cuda", dtype=torch.bfloat16))
    x = torch.randn(64, 512, generator=gen).to("cuda", torch.bfloat16)
    layer(x).sum().backward()
    torch.optim.SGD(layer.parameters(), lr=1.0).step()
    expected = torch.nn.functional.linear(x.double(), layer.weight.double(), layer.bias.double())
    assert rel_err(layer(x), expected) < FP8_TOL


@pytest.mark.parametrize("m,n,k", [(48, 64, 128), (130, 256, 384), (7, 32, 768)])
def test_emulated_linear_is_close_to_float64(gen, m, n, k):
    """The CPU path (exact emulation): same bounds as the GPU, no GPU needed."""
    x, w, b, dy = make_case(gen, m, n, k, "cpu")
    fp8 = run_fwd_bwd(lambda x, w, b: fp8_blockwise_linear(x, w, b), x, w, b, dy)
    exact = run_fwd_bwd(float64_linear, x.double(), w.double(), b.double(), dy.double())
    for name, f, e in zip(("y", "dx", "dw", "db"), fp8, exact):
        assert rel_err(f, e) < FP8_TOL, name


def test_misaligned_features_are_refused_with_the_arithmetic():
    with pytest.raises(ValueError, match=r"out=100 \(= 6 \* 16 \+ 4\)"):
        FP8BlockwiseLinear(64, 100)
