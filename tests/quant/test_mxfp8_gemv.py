"""The MXFP8 weight-only decode linear (`int4_mxfp8_linear.mxfp8_weight_only_linear`,
`mxfp8_grouped_weight_only_linear`) on the CPU, where both run the reference: the fp32 product of x
and the weight `mxfp8.dequantize` gives (e4m3 codes times their E8M0 scale, rounded to bf16: the
trainer's weight). The Gluon kernel behind them on a GPU (`gluon_wo_gemv.linear_mxfp8`) is compiled
for sm_90 by tests/quant/test_gluon_wo_gemv.py and checked on the H200 by tests/gpu/test_gluon_wo_gpu.py.
"""

from __future__ import annotations

import pytest
import torch

from skyq.quant import mxfp8
from skyq.quant.errors import QuantizationError
from skyq.rollout.kernels import int4_mxfp8_linear
from tests.interpreter_run import seeded_generator


def operands(gen: torch.Generator, m: int, n: int, k: int, *, experts: int | None = None):
    """bf16 x [m, K] and MXFP8 codes and E8M0 scales of a weight ([E,] N, K) whose rows' magnitudes
    span several decades."""
    x = (torch.randn(m, k, generator=gen) * 10.0 ** (torch.rand(m, 1, generator=gen) * 2 - 1)).to(
        torch.bfloat16
    )
    shape = (n, k) if experts is None else (experts, n, k)
    w = torch.randn(shape, generator=gen) * 10.0 ** (torch.rand(*shape[:-1], 1, generator=gen) * 3 - 2)
    q, s = mxfp8.quantize(w)
    return x, q, s


def within_tolerance(got: torch.Tensor, x, q, s) -> bool:
    """|got - exact| <= 2^-8 |exact| (got rounded to bf16) + 2^-16 (|x| @ |W|^T) (fp32 sums in
    another order), exact = the float64 product of x and the dequantized weight."""
    w = mxfp8.dequantize(q, s, dtype=torch.float32).double()
    ref, mag = x.double() @ w.T, x.double().abs() @ w.abs().T
    return bool(((got.double() - ref).abs() <= ref.abs() * 2.0**-8 + mag * 2.0**-16).all())


def test_the_reference_is_the_fp32_product_with_the_dequantized_weight():
    gen = seeded_generator()
    x, q, s = operands(gen, 5, 96, 256)
    got = int4_mxfp8_linear.mxfp8_weight_only_linear(x, q, s)
    w = mxfp8.dequantize(q, s, dtype=torch.bfloat16)
    assert got.dtype == torch.bfloat16 and got.shape == (5, 96)
    assert torch.equal(got, (x.float() @ w.float().T).to(torch.bfloat16))
    assert within_tolerance(got, x, q, s)
    assert torch.equal(
        int4_mxfp8_linear.mxfp8_weight_only_linear(x.reshape(1, 5, 256), q, s), got.reshape(1, 5, 96)
    )
    assert not int4_mxfp8_linear.mxfp8_kernel_takes(x, q, s)  # CPU tensors: the kernel needs CUDA


def test_the_grouped_reference_is_each_experts_product():
    gen = seeded_generator()
    x, q, s = operands(gen, 9, 64, 128, experts=3)
    offsets = torch.tensor([0, 4, 4, 9], dtype=torch.int32)  # expert 1 has no rows
    got = int4_mxfp8_linear.mxfp8_grouped_weight_only_linear(x, q, s, offsets)
    assert got.shape == (9, 64)
    for e, (a, b) in enumerate(((0, 4), (4, 4), (4, 9))):
        assert torch.equal(got[a:b], int4_mxfp8_linear.mxfp8_weight_only_linear(x[a:b], q[e], s[e]))


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda x, q, s: (x, q.float(), s), "float8_e4m3fn"),
        (lambda x, q, s: (x, q, s[:, :-1]), "weight_scale must be uint8"),
        (lambda x, q, s: (x, q, s.to(torch.int32)), "weight_scale must be uint8"),
        (lambda x, q, s: (x[:, :-32], q, s), "K=224 but the weight has K=256"),
        (lambda x, q, s: (x, q[None], s[None]), r"must be \[N, K\]"),
    ],
)
def test_bad_arguments_are_refused_by_name(mutate, match):
    x, q, s = operands(seeded_generator(), 3, 64, 256)
    with pytest.raises(QuantizationError, match=match):
        int4_mxfp8_linear.mxfp8_weight_only_linear(*mutate(x, q, s))


def test_bad_grouped_arguments_are_refused_by_name():
    x, q, s = operands(seeded_generator(), 6, 64, 128, experts=2)
    with pytest.raises(QuantizationError, match=r"offsets must be int32 \[3\]"):
        int4_mxfp8_linear.mxfp8_grouped_weight_only_linear(x, q, s, torch.tensor([0, 6], dtype=torch.int32))
    with pytest.raises(QuantizationError, match=r"must be \[E, N, K\]"):
        int4_mxfp8_linear.mxfp8_grouped_weight_only_linear(
            x, q[0], s[0], torch.tensor([0, 3, 6], dtype=torch.int32)
        )
