"""The FP8 weight-only decode linear and the batched finite checks, on the CPU.

The reference path (`x.float() @ dequantize(q, s, bfloat16).float().T`) is what `fp8_weight_only_linear`
runs without CUDA. The Triton kernel multiplies by the bf16-dequantized weight, as the trainer
does; under the Triton interpreter (where Triton is importable; skipped where Triton is not installed)
it is checked against `x.float() @ dequantize(q, s, bfloat16).float().T`: bit for bit where
summation order cannot matter, and within fp32 summation noise of it elsewhere. The interpreter
check runs this file as a script in a subprocess, because TRITON_INTERPRET must be set before
`@triton.jit` runs.
"""

from __future__ import annotations

import importlib.util
import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from skyq.quant import fp8_blockwise
from skyq.quant.errors import QuantizationError
from skyq.quant.kernels import _common, dispatch
from skyq.rollout.kernels import fp8_linear

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def gen() -> torch.Generator:
    seed = int(os.environ.get("SKYQ_TEST_SEED", secrets.randbits(32)))
    print(f"SKYQ_TEST_SEED={seed}")
    return torch.Generator().manual_seed(seed)


def _quantized_weight(gen: torch.Generator, n: int, k: int, block=(128, 128)):
    w = torch.randn(n, k, generator=gen) * torch.logspace(-3, 1, n).unsqueeze(1)
    return fp8_blockwise.quantize(w, block_size=block)


def bf16_weight_product(
    x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, block
) -> tuple[torch.Tensor, torch.Tensor]:
    """(`x.float() @ W.float().T`, `|x| @ |W|^T`) for the trainer's weight W = dequantize(q, s, bf16)."""
    w = fp8_blockwise.dequantize(q, s, block_size=block, dtype=torch.bfloat16).float()
    return x.float() @ w.T, x.float().abs() @ w.abs().T


def within_tolerance(got: torch.Tensor, x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, block) -> bool:
    """|got - ref| <= 2^-8 |ref| (got rounded to bf16) + 2^-18 (|x| @ |W|^T) (fp32 summation order),
    ref the product with the bf16-dequantized weight. The fp32-scaled weight (the kernel's former
    numerics) is ~2e-4 (|x| @ |W|^T) away at its worst, so the second term does not admit it."""
    ref, mag = bf16_weight_product(x, q, s, block)
    bound = ref.abs() * (2.0**-8 if got.dtype == torch.bfloat16 else 0.0) + 2.0**-18 * mag
    return bool(((got.float() - ref).abs() <= bound).all())


def test_reference_path_is_the_fp32_product_of_the_bf16_dequantized_weight(gen):
    q, s = _quantized_weight(gen, 300, 260)
    x = torch.randn(3, 5, 260, generator=gen).to(torch.bfloat16)
    got = fp8_linear.fp8_weight_only_linear(x, q, s)
    ref = (x.float() @ fp8_blockwise.dequantize(q, s, dtype=torch.bfloat16).float().T).to(torch.bfloat16)
    assert got.shape == (3, 5, 300) and got.dtype == torch.bfloat16
    assert torch.equal(got, ref)


def test_mismatched_linear_arguments_are_refused_by_name(gen):
    q, s = _quantized_weight(gen, 64, 256)
    x = torch.randn(2, 256, generator=gen).to(torch.bfloat16)
    with pytest.raises(QuantizationError, match="do not match"):
        fp8_linear.fp8_weight_only_linear(x[:, :128], q, s)
    with pytest.raises(QuantizationError, match="weight_scale_inv"):
        fp8_linear.fp8_weight_only_linear(x, q, s[:, :1])
    with pytest.raises(QuantizationError, match="float8_e4m3fn"):
        fp8_linear.fp8_weight_only_linear(x, q.float(), s)


def test_deferred_checks_name_the_first_bad_tensor_in_call_order():
    seen = []

    def bad(name):
        def validate():
            seen.append(name)
            raise QuantizationError(f"{name}: bad")

        return validate

    scope = _common.DeferredChecks(max_pending=100)
    scope.add(torch.zeros(1, dtype=torch.int32), bad("a"), strict=True)
    scope.add(torch.ones(1, dtype=torch.int32), bad("b"), strict=True)
    scope.add(torch.ones(1, dtype=torch.int32), bad("c"), strict=True)
    with pytest.raises(QuantizationError, match="b: bad"):
        scope.flush()
    assert seen == ["b"] and scope.pending == []


def test_deferred_false_alarm_of_a_sum_check_passes():
    scope = _common.DeferredChecks(max_pending=100)
    scope.add(torch.ones(1, dtype=torch.bool), lambda: None, strict=False)
    scope.flush()


def test_deferred_scope_on_cpu_checks_at_once_with_the_reference_error():
    w = torch.ones(4, 64)
    w[0, 3] = float("inf")
    with pytest.raises(QuantizationError, match="layer: 0 NaN and 1 inf"), dispatch.deferred_finite_checks():
        dispatch.check_finite_deferred(w, "layer")
    with pytest.raises(QuantizationError, match="layer: 0 NaN and 1 inf"), dispatch.deferred_finite_checks():
        dispatch.quantize_fp8_blockwise(w, name="layer")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_gemv_kernel_matches_the_reference_under_the_triton_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, __file__], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600
    )
    assert out.returncode == 0 and "interpreter: gemv matches" in out.stdout, out.stdout + out.stderr


def _bf16_interpreter_dot() -> None:
    """Triton 3.6's interpreter stores bf16 as uint16 and multiplies those integers in `tl.dot`, and
    accumulates fp16 operands in fp16; widen both to fp32 first (exact), as the GPU's MMA with fp32
    accumulation does."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    integer_dot = interpreter.InterpreterBuilder.create_dot

    def widened(handle):
        if handle.dtype.scalar == tl.float16:
            return interpreter.TensorHandle(handle.data.astype(np.float32), tl.float32)
        if handle.dtype.scalar != tl.bfloat16:
            return handle
        raw = torch.from_numpy(np.ascontiguousarray(handle.data).view(np.int16).copy()).view(torch.bfloat16)
        return interpreter.TensorHandle(raw.float().numpy(), tl.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return integer_dot(self, widened(a), widened(b), d, input_precision, max_num_imprecise_acc)

    interpreter.InterpreterBuilder.create_dot = create_dot


def _interpreter_main() -> None:
    from tests.interpreter_run import seeded_generator
    from tests.quant.test_kernel_dispatch import _exact_interpreter_casts

    _exact_interpreter_casts()
    _bf16_interpreter_dot()
    from skyq.rollout.kernels import triton_fp8_gemv

    gen = seeded_generator()
    failures = []
    cases = [  # (M, N, K, block, forced (BM, BN, TK, split) or None)
        (1, 200, 300, (128, 128), None),
        (5, 70, 260, (128, 128), (16, 32, 128, 2)),
        (17, 130, 384, (128, 128), (32, 64, 128, 3)),
        (64, 96, 200, (64, 32), (64, 32, 32, 4)),
        (40, 33, 129, (128, 128), (64, 64, 128, 1)),
        (3, 150, 1024, (128, 128), (16, 128, 128, 8)),
        (33, 260, 1300, (128, 128), (64, 256, 128, 1)),  # 11 K tiles in one split: 16 scale columns
        (2, 130, 1000, (128, 256), (16, 64, 128, 3)),  # two K tiles per scale column, a split mid-block
        (64, 70, 640, (128, 128), (64, 128, 128, 5)),  # one K tile per split
        # K tiles of several scale blocks (scales loaded per sub-tile in the loop), 16-row weight tiles
        (1, 200, 1100, (128, 128), (16, 16, 512, 1)),  # a ragged last tile: 3 of 4 sub-tiles past K
        (9, 260, 700, (128, 128), (16, 32, 256, 2)),  # the second split runs past K, 9 > SCALES_IN_LOOP_MAX_M
        (3, 100, 300, (32, 64), (16, 16, 128, 1)),  # 32 x 64 blocks: two scale columns per K tile
        (2, 100, 300, (32, 64), (16, 64, 256, 1)),  # and two scale rows per weight tile (not uniform)
        (33, 130, 900, (64, 128), (64, 64, 256, 2)),
        # the CUDA-core kernel (BM < 16): one row, a few rows over two row tiles, split K, not uniform
        (1, 200, 1100, (128, 128), (1, 16, 512, 1)),
        (3, 70, 700, (128, 128), (2, 32, 256, 2)),
        (4, 100, 300, (32, 64), (4, 64, 128, 3)),
    ]
    for m, n, k, block, config in cases:
        q, s = _quantized_weight(gen, n, k, block)
        # activations with outlier rows and columns, 10 decades apart
        x = torch.randn(m, k, generator=gen) * 10.0 ** (torch.rand(m, 1, generator=gen) * 6 - 3)
        x[:, :: max(1, k // 7)] *= 1e4
        x = x.to(torch.bfloat16)
        got = triton_fp8_gemv.linear(x, q, s, block_size=block, config=config)
        # fp32 activations (bf16 values) give the fp32 accumulator itself, before any rounding
        got32 = triton_fp8_gemv.linear(x.float(), q, s, block_size=block, config=config)
        if got.shape != (m, n) or not within_tolerance(got, x, q, s, block):
            failures.append(("bf16 out", m, n, k, block, config))
        if not within_tolerance(got32, x, q, s, block):
            failures.append(("fp32 out", m, n, k, block, config))
        # two nonzero activations per row: every summation order gives fl(a + b), so the kernel's
        # sums equal the reference's bit for bit iff its weights are bf16(fp32(q) * s)
        x2 = torch.zeros(m, k)
        for row in range(m):
            cols = torch.randperm(k, generator=gen)[:2]
            x2[row, cols] = torch.randint(0, 2, (2,), generator=gen).float() * 2 - 1
        ref = bf16_weight_product(x2, q, s, block)[0]
        for xi in (x2.to(torch.bfloat16), x2):
            if not torch.equal(
                triton_fp8_gemv.linear(xi, q, s, block_size=block, config=config), ref.to(xi.dtype)
            ):
                failures.append(("two-term exact", xi.dtype, m, n, k, block, config))
    if failures:
        print("interpreter: gemv FAILED", failures)
        sys.exit(1)
    print("interpreter: gemv matches")


if __name__ == "__main__":
    _interpreter_main()
