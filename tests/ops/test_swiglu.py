"""skyq's fused `silu(gate) * up` (`skyq.ops.swiglu`), on the CPU.

Off CUDA, and with autograd recording, it is the torch expression itself. The Triton kernel is checked
under the Triton interpreter (where Triton is importable; the set-up installs it) on the strided halves
of a stacked gate+up output, against torch's expression to within two units in the last place of bf16
and fp16 (the interpreter's exp is not libdevice's); tests/gpu/test_swiglu_gpu.py checks the kernel
against torch's CUDA ops bit for bit.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN

from skyq.ops.swiglu import is_silu, silu_mul, silu_mul_reference
from tests.interpreter_run import kernels_on_cpu, report, run_under_interpreter, seeded_generator

ROOT = Path(__file__).resolve().parents[2]
CASES = [(1, 768), (7, 768), (64, 768), (3, 100), (5, 1500), (2, 3)]


def stacked_halves(gen: torch.Generator, rows: int, width: int, dtype: torch.dtype, device="cpu"):
    """gate and up as the two halves of one [rows, 2 * width] output (row stride 2 * width)."""
    gate_up = (torch.randn(rows, 2 * width, generator=gen) * 4).to(dtype).to(device)
    return gate_up[:, :width], gate_up[:, width:]


def test_is_silu_knows_torch_and_transformers_silu_only():
    assert is_silu(F.silu) and is_silu(torch.nn.SiLU()) and is_silu(ACT2FN["silu"])
    assert not is_silu(F.gelu) and not is_silu(ACT2FN["gelu"]) and not is_silu(torch.nn.ReLU())


def test_off_cuda_and_under_autograd_it_is_the_torch_expression():
    gen = torch.Generator().manual_seed(0)
    gate, up = stacked_halves(gen, 4, 96, torch.bfloat16)
    assert torch.equal(silu_mul(gate, up), F.silu(gate) * up)
    g, u = gate.float().requires_grad_(), up.float().requires_grad_()
    silu_mul(g, u).sum().backward()
    assert g.grad is not None and u.grad is not None


def ulps_apart(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Units in the last place of got's dtype between got and want, elementwise (subnormals' ulp below
    the smallest normal binade)."""
    info = torch.finfo(got.dtype)
    mantissa = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23}[got.dtype]
    mag = torch.maximum(got.double().abs(), want.double().abs()).clamp_min(info.tiny)
    _, exponent = torch.frexp(mag)  # mag = f * 2^exponent, f in [0.5, 1)
    ulp = torch.pow(2.0, (exponent - 1).double() - mantissa)
    return (got.double() - want.double()).abs() / ulp


def check_kernel(gen: torch.Generator, device: str, exact: bool) -> list:
    """Kernel vs torch's expression on stacked halves of every CASE, bf16 / fp16 / fp32: equal bits
    (`exact`), or, the interpreter's exp being numpy's (a few fp32 ulps from torch's), within 8 ulps in
    fp32 and 2 in bf16 / fp16 (silu one ulp off, then the product's rounding), >= 99% equal."""
    failures = []
    for rows, width in CASES:
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            gate, up = stacked_halves(gen, rows, width, dtype, device)
            got, want = silu_mul(gate, up), silu_mul_reference(gate, up)
            if got.shape != want.shape or got.dtype != want.dtype or not got.is_contiguous():
                failures.append((rows, width, dtype, "layout"))
            elif exact and not torch.equal(got, want):
                failures.append((rows, width, dtype, int((got != want).sum())))
            elif not exact and (
                ulps_apart(got, want).max() > (8 if dtype == torch.float32 else 2)
                or (dtype != torch.float32 and (got == want).float().mean() < 0.99)
            ):
                failures.append((rows, width, dtype, float(ulps_apart(got, want).max())))
    return failures


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_silu_mul_kernel_under_the_triton_interpreter():
    run_under_interpreter(str(Path(__file__)), marker="interpreter: silu_mul matches")


def _interpreter_main() -> None:
    kernels_on_cpu()
    report("silu_mul", check_kernel(seeded_generator(), "cpu", exact=False))


if __name__ == "__main__" and "--interpret" in sys.argv:
    sys.path.insert(0, str(ROOT))
    _interpreter_main()
