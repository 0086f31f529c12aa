"""The router's expert choice (`skyq.ops.router`), on the CPU.

Off CUDA `select_experts` is transformers' router bit for bit. The Triton kernel is checked under
the Triton interpreter (where Triton is importable; the set-up installs it) and on the H200
(tests/gpu/test_router_gpu.py): the same experts in the same order as torch's top-k where the
probabilities are distinct, weights within fp32 rounding of torch's, ties to the lower expert, a
NaN row still naming experts of the layer, and a token's choice independent of its batch.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

from skyq.ops import router
from skyq.ops.router import TopKRouter, _SelectFn, select_experts, select_experts_reference
from skyq.quant.kernels import dispatch
from tests.interpreter_run import kernels_on_cpu, report, run_under_interpreter, seeded_generator

ROOT = Path(__file__).resolve().parents[2]
CASES = [(1, 32, 4, True), (9, 128, 8, True), (5, 60, 6, False), (3, 384, 8, True), (64, 16, 1, True)]


@pytest.mark.parametrize("norm", [True, False])
def test_off_cuda_router_is_the_transformers_router_bit_for_bit(norm):
    from types import SimpleNamespace

    gen = torch.Generator().manual_seed(4)
    config = SimpleNamespace(num_experts_per_tok=4, num_experts=16, norm_topk_prob=norm, hidden_size=32)
    stock = Qwen3MoeTopKRouter(config)
    with torch.no_grad():
        stock.weight.copy_(torch.randn(16, 32, generator=gen))
    stock = stock.to(torch.bfloat16)
    ours = TopKRouter(stock.weight, 4, norm)
    x = torch.randn(7, 32, generator=gen).to(torch.bfloat16)
    for got, want in zip(ours(x), stock(x), strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want)


def test_backward_is_the_gradient_of_the_routing_weights():
    gen = torch.Generator().manual_seed(5)
    logits0 = torch.randn(6, 32, generator=gen).to(torch.bfloat16)
    dv = torch.randn(6, 4, generator=gen).to(torch.bfloat16)
    ours = logits0.clone().requires_grad_()
    values, indices = _SelectFn.apply(ours, 4, True, select_experts_reference)
    values.backward(dv)
    ref = logits0.clone().requires_grad_()
    want_values, want_indices = select_experts_reference(ref, 4, True)
    want_values.backward(dv)
    assert torch.equal(indices, want_indices) and not indices.requires_grad
    assert torch.allclose(ours.grad.float(), ref.grad.float(), rtol=0, atol=1e-2)


def check_select(gen: torch.Generator, device: str = "cpu") -> list[str]:
    """The kernel path (`select_experts` where the kernel applies) against the reference."""
    failures = []
    for t, e, k, norm in CASES:
        # distinct logits (a random order of evenly spaced values), so the top-k is unique: bf16
        # where its spacing survives the rounding, fp32 for the wide routers
        spaced = torch.stack([torch.randperm(e, generator=gen) for _ in range(t)]).float() * (8 / e) - 4
        logits = spaced.to(torch.bfloat16 if e <= 128 else torch.float32).to(device)
        if dispatch.uses_kernel(logits) and not router._kernel_applies(logits, k):
            failures.append(f"{(t, e, k, norm)}: the kernel refused")
        values, indices = select_experts(logits, k, norm)
        want_v, want_i = select_experts_reference(logits, k, norm)
        if not torch.equal(indices, want_i):
            failures.append(f"{(t, e, k, norm)}: experts differ")
        # one bf16 step, or a few fp32 roundings (another summation order, another exp)
        tol = 2 * torch.finfo(torch.bfloat16).eps if logits.dtype == torch.bfloat16 else 1e-6
        if not torch.allclose(values.float(), want_v.float(), rtol=tol, atol=0):
            failures.append(
                f"{(t, e, k, norm)}: weights differ by {(values.float() - want_v.float()).abs().max()}"
            )
        for r in {0, t - 1}:
            alone = select_experts(logits[r : r + 1], k, norm)
            if not (torch.equal(alone[0][0], values[r]) and torch.equal(alone[1][0], indices[r])):
                failures.append(f"{(t, e, k, norm)}: row {r} alone differs from it in the batch")
    tie = torch.zeros(2, 8, dtype=torch.bfloat16, device=device)
    tie[1, 5] = 1.0
    _, idx = select_experts(tie, 3, True)
    if idx.tolist() != [[0, 1, 2], [5, 0, 1]]:
        failures.append(f"ties: {idx.tolist()}")
    nan = torch.full((1, 8), float("nan"), dtype=torch.bfloat16, device=device)
    values, idx = select_experts(nan, 3, True)
    if sorted(idx[0].tolist()) != [0, 1, 2] or not torch.isnan(values).all():
        failures.append(f"NaN row: {idx.tolist()} {values.tolist()}")
    return failures


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_router_kernel_under_the_triton_interpreter():
    run_under_interpreter(str(Path(__file__)), marker="interpreter: router matches")


def _interpreter_main() -> None:
    kernels_on_cpu()
    failures = check_select(seeded_generator())
    report("router", failures)


if __name__ == "__main__" and "--interpret" in sys.argv:
    sys.path.insert(0, str(ROOT))
    _interpreter_main()
