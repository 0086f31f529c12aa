"""The FP8 x FP8 decode linear (`fp8_linear.fp8_w8a8_linear`, `fp8_grouped_w8a8_linear`) on the CPU.

Without CUDA both run the reference: the fp32 product of the dequantized activation codes (1 x 128
tiles) and weight codes (128 x 128 blocks). The Triton kernel (`triton_fp8_w8a8`) is checked against
it under the Triton interpreter (a subprocess: TRITON_INTERPRET must be set before `@triton.jit`
runs): within fp32 summation noise for random data, and bit for bit where no summation order can
matter (power-of-two scales, two nonzero activations a row in two scale blocks).
"""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch

from skyq.quant import fp8_blockwise
from skyq.quant.errors import QuantizationError
from skyq.quant.fake_quant import Fp8ActivationQuant
from skyq.rollout.kernels import fp8_linear
from tests.interpreter_run import run_under_interpreter, seeded_generator


def _operands(
    gen: torch.Generator, m: int, n: int, k: int, *, experts: int | None = None, pow2: bool = False
):
    """Activation codes / scales [m, K] and weight codes / scales ([E,] N, K) of random data whose
    magnitudes span several decades (so the scales differ block to block)."""
    x = torch.randn(m, k, generator=gen) * 10.0 ** (torch.rand(m, 1, generator=gen) * 4 - 2)
    xq, xs = fp8_blockwise.quantize_activation(x.to(torch.bfloat16), pow2_scale=pow2)
    shape = (n, k) if experts is None else (experts, n, k)
    w = torch.randn(shape, generator=gen) * 10.0 ** (torch.rand(*shape[:-1], 1, generator=gen) * 4 - 3)
    q, s = fp8_blockwise.quantize(w, pow2_scale=pow2)
    return xq, xs, q, s


def _float64_product(xq, xs, q, s) -> tuple[torch.Tensor, torch.Tensor]:
    """(dequant(x) @ dequant(W)^T, |dequant(x)| @ |dequant(W)|^T) in float64."""
    x = fp8_blockwise.dequantize_activation(xq, xs, dtype=torch.float32).double()
    w = fp8_blockwise.dequantize(q, s, dtype=torch.float32).double()
    return x @ w.T, x.abs() @ w.abs().T


def within_tolerance(got: torch.Tensor, xq, xs, q, s, *, sum_bits: int = 16) -> bool:
    """|got - exact| <= 2^-8 |exact| (got rounded to bf16) + 2^-sum_bits (|x| @ |W|^T): fp32 sums in
    another order (16); on a GPU the FP8 tensor core's adder within a 128-column block keeps fewer
    bits than fp32 (12: the H200 gave up to 6e-5 of |x| @ |W|^T at K = 768, 1.4e-5 at K = 4096)."""
    ref, mag = _float64_product(xq, xs, q, s)
    bound = ref.abs() * (2.0**-8 if got.dtype == torch.bfloat16 else 0.0) + 2.0**-sum_bits * mag
    return bool(((got.double() - ref).abs() <= bound).all())


def test_reference_is_the_fp32_product_of_the_dequantized_codes():
    gen = seeded_generator()
    xq, xs, q, s = _operands(gen, 5, 200, 320)
    got = fp8_linear.fp8_w8a8_linear(xq, xs, q, s)
    x = fp8_blockwise.dequantize_activation(xq, xs, dtype=torch.float32)
    assert got.dtype == torch.bfloat16 and got.shape == (5, 200)
    assert torch.equal(got, (x @ fp8_blockwise.dequantize(q, s, dtype=torch.float32).T).to(torch.bfloat16))
    assert within_tolerance(got, xq, xs, q, s)
    assert fp8_linear.fp8_w8a8_linear(xq, xs, q, s, out_dtype=torch.float32).dtype == torch.float32


def test_the_grouped_reference_is_each_experts_product_of_its_rows_gathered():
    gen = seeded_generator()
    xq, xs, q, s = _operands(gen, 6, 256, 384, experts=3)
    index = torch.tensor([5, 0, 0, 3, 1, 2, 4, 5, 1])  # 9 routed rows of 6 tokens
    offsets = torch.tensor([0, 4, 4, 9], dtype=torch.int32)  # expert 1 has no rows
    got = fp8_linear.fp8_grouped_w8a8_linear(xq, xs, q, s, offsets, index=index)
    assert got.shape == (9, 256)
    for e, (a, b) in enumerate(((0, 4), (4, 4), (4, 9))):
        rows = index[a:b]
        assert torch.equal(got[a:b], fp8_linear.fp8_w8a8_linear(xq[rows], xs[rows], q[e], s[e]))
    plain = fp8_linear.fp8_grouped_w8a8_linear(xq[index], xs[index], q, s, offsets)
    assert torch.equal(plain, got)


def test_bad_arguments_are_refused_by_name():
    gen = seeded_generator()
    xq, xs, q, s = _operands(gen, 4, 128, 256, experts=2)
    offsets = torch.tensor([0, 1, 4], dtype=torch.int32)
    with pytest.raises(QuantizationError, match="activation codes.*float8_e4m3fn"):
        fp8_linear.fp8_w8a8_linear(xq.float(), xs, q[0], s[0])
    with pytest.raises(QuantizationError, match="activation scales"):
        fp8_linear.fp8_w8a8_linear(xq, xs[:, :1], q[0], s[0])
    with pytest.raises(QuantizationError, match="weight_scale_inv"):
        fp8_linear.fp8_w8a8_linear(xq, xs, q[0], s[0, :, :1])
    with pytest.raises(QuantizationError, match="do not match"):
        fp8_linear.fp8_w8a8_linear(xq[:, :128], xs[:, :1], q[0], s[0])
    with pytest.raises(QuantizationError, match=r"weight must be \[N, K\]"):
        fp8_linear.fp8_w8a8_linear(xq, xs, q, s)
    with pytest.raises(QuantizationError, match=r"weight must be \[E, N, K\]"):
        fp8_linear.fp8_grouped_w8a8_linear(xq, xs, q[0], s[0], offsets)
    with pytest.raises(QuantizationError, match="offsets must be int32"):
        fp8_linear.fp8_grouped_w8a8_linear(xq, xs, q, s, offsets.long())
    with pytest.raises(QuantizationError, match="must rise from 0 to the 4 routed rows"):
        fp8_linear.fp8_grouped_w8a8_linear(xq, xs, q, s, torch.tensor([0, 3, 2], dtype=torch.int32))
    with pytest.raises(QuantizationError, match="must rise from 0 to the 5 routed rows"):
        fp8_linear.fp8_grouped_w8a8_linear(xq, xs, q, s, offsets, index=torch.tensor([0, 1, 2, 3, 0]))
    with pytest.raises(QuantizationError, match=r"index values must lie in \[0, 4\)"):
        fp8_linear.fp8_grouped_w8a8_linear(xq, xs, q, s, offsets, index=torch.tensor([0, 1, 4, 3]))
    with pytest.raises(QuantizationError, match="index must be int32 / int64"):
        fp8_linear.fp8_grouped_w8a8_linear(xq, xs, q, s, offsets, index=torch.tensor([0.0, 1, 2, 3]))


@pytest.mark.parametrize("pow2", [False, True])
def test_the_activation_quantizers_codes_are_what_its_fake_quant_dequantizes(pow2):
    gen = seeded_generator()
    quantizer = Fp8ActivationQuant(tile=128, pow2_scale=pow2)
    x = (torch.randn(7, 384, generator=gen) * 3).to(torch.bfloat16)
    xq, xs = quantizer.codes(x)
    assert xq.dtype == torch.float8_e4m3fn and xs.shape == (7, 3)
    dequantized = fp8_blockwise.dequantize_activation(xq, xs, dtype=torch.bfloat16)
    assert torch.equal(dequantized, quantizer(x))
    assert not pow2 or bool((torch.frexp(xs).mantissa == 0.5).all())


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_the_kernel_matches_the_reference_under_the_triton_interpreter():
    run_under_interpreter(__file__, "interpreter: w8a8 matches")


def _interpreter_main() -> None:
    from tests.interpreter_run import kernels_on_cpu, report

    kernels_on_cpu()
    from skyq.rollout.kernels import triton_fp8_w8a8 as kernels

    gen = seeded_generator()
    failures = []
    # dense: row and column tails (K 320: a 64-column last block; N 192: half a scale block), tiles
    for m, n, k, config in (
        (5, 192, 320, None),
        (40, 256, 384, (16, 64, 2, 4, 2)),
        (70, 128, 256, (32, 128, 1, 4, 2)),
        (33, 200, 128, (64, 64, 1, 4, 1)),
    ):
        xq, xs, q, s = _operands(gen, m, n, k)
        got = kernels.linear(xq, xs, q, s, config=config)
        if got.shape != (m, n) or not within_tolerance(got, xq, xs, q, s):
            failures.append(("dense", m, n, k, config))
        got32 = kernels.linear(xq, xs, q, s, out_dtype=torch.float32, config=config)
        if not within_tolerance(got32, xq, xs, q, s):
            failures.append(("dense fp32 out", m, n, k, config))
    # grouped, rows gathered through an index, an expert without rows, row tiles spread (MT 2)
    tokens, n, k = 11, 192, 320
    xq, xs, q, s = _operands(gen, tokens, n, k, experts=4)
    counts = [7, 0, 20, 3]
    offsets = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32)
    index = torch.randint(0, tokens, (sum(counts),), generator=gen)
    for config in (None, (16, 64, 2, 4, 2), (16, 128, 1, 4, 3)):
        got = kernels.linear_grouped(xq, xs, q, s, offsets, index=index, config=config)
        for e, (a, b) in enumerate(zip(offsets.tolist(), offsets.tolist()[1:])):
            rows = index[a:b]
            if b > a and not within_tolerance(got[a:b], xq[rows], xs[rows], q[e], s[e]):
                failures.append(("grouped", e, config))
    # exact: power-of-two scales and two nonzero activations a row in two 128-column blocks, so every
    # product and sum is one rounding in any order: the kernel equals the reference bit for bit
    m, n, k = 9, 128, 384
    xq, xs, q, s = _operands(gen, m, n, k, pow2=True)
    codes = torch.zeros(m, k)
    for row in range(m):
        cols = torch.randperm(3, generator=gen)[:2] * 128 + torch.randint(0, 128, (2,), generator=gen)
        codes[row, cols] = torch.randint(1, 8, (2,), generator=gen).float()
    xq = codes.to(torch.float8_e4m3fn)
    if not torch.equal(kernels.linear(xq, xs, q, s), fp8_linear.fp8_w8a8_linear_reference(xq, xs, q, s)):
        failures.append("two-term exact")
    report("w8a8", failures)


if __name__ == "__main__" and "--interpret" in sys.argv:
    _interpreter_main()
