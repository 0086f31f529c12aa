"""The INT4 weight-only decode linear (`int4_mxfp8_linear.int4_weight_only_linear`,
`int4_grouped_weight_only_linear`) on the CPU.

Without CUDA both run the reference: the fp32 product of x and the weight `int4.dequantize_packed`
gives (codes times their group's bf16 scale, rounded to bf16: the trainer's weight). The Triton
kernel (`triton_int4_gemv`) is checked against it under the Triton interpreter (a subprocess:
TRITON_INTERPRET must be set before `@triton.jit` runs): within fp32 summation noise for random data,
and bit for bit where no summation order can matter (one nonzero activation a row); its dequantizer
(`skyq.quant.kernels.triton_int4_dequant.dequantize`) gives `int4.dequantize_packed`'s bits. The kernel's PTX
dequantization (sm_90) cannot run there; tests/gpu/test_int4_gemv_gpu.py checks it on the H200.
"""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch

from skyq.quant import int4
from skyq.quant.errors import QuantizationError
from skyq.rollout.kernels import int4_mxfp8_linear
from tests.interpreter_run import run_under_interpreter, seeded_generator


def operands(gen: torch.Generator, m: int, n: int, k: int, group: int, *, experts: int | None = None):
    """bf16 x [m, K] and symmetric INT4 (packed words, bf16 group scales) of a weight ([E,] N, K) whose
    rows' magnitudes span several decades."""
    x = (torch.randn(m, k, generator=gen) * 10.0 ** (torch.rand(m, 1, generator=gen) * 2 - 1)).to(
        torch.bfloat16
    )
    shape = (n, k) if experts is None else (experts, n, k)
    w = torch.randn(shape, generator=gen) * 10.0 ** (torch.rand(*shape[:-1], 1, generator=gen) * 3 - 2)
    q, s = int4.quantize(w, group_size=group)
    return x, int4.pack(q), s


def _weight(packed: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    n, k = packed.shape[-2], packed.shape[-1] * 8
    return int4.dequantize_packed(packed, scale, (n, k), group_size=group)


def within_tolerance(got: torch.Tensor, x, packed, scale, group: int) -> bool:
    """|got - exact| <= 2^-8 |exact| (got rounded to bf16) + 2^-16 (|x| @ |W|^T) (fp32 sums in
    another order), exact = the float64 product of x and the dequantized weight."""
    w = _weight(packed, scale, group).double()
    ref, mag = x.double() @ w.T, x.double().abs() @ w.abs().T
    return bool(((got.double() - ref).abs() <= ref.abs() * 2.0**-8 + mag * 2.0**-16).all())


def test_reference_is_the_fp32_product_with_the_dequantized_weight():
    gen = seeded_generator()
    x, packed, scale = operands(gen, 5, 96, 256, 32)
    got = int4_mxfp8_linear.int4_weight_only_linear(x, packed, scale, 32)
    assert got.dtype == torch.bfloat16 and got.shape == (5, 96)
    assert torch.equal(got, (x.float() @ _weight(packed, scale, 32).float().T).to(torch.bfloat16))
    x3 = x.reshape(1, 5, 256)
    assert torch.equal(
        int4_mxfp8_linear.int4_weight_only_linear(x3, packed, scale, 32), got.reshape(1, 5, 96)
    )


def test_the_grouped_reference_is_each_experts_product():
    gen = seeded_generator()
    x, packed, scale = operands(gen, 9, 64, 128, 32, experts=3)
    offsets = torch.tensor([0, 4, 4, 9], dtype=torch.int32)  # expert 1 has no rows
    got = int4_mxfp8_linear.int4_grouped_weight_only_linear(x, packed, scale, offsets, 32)
    assert got.shape == (9, 64)
    for e, (a, b) in enumerate(((0, 4), (4, 4), (4, 9))):
        assert torch.equal(
            got[a:b], int4_mxfp8_linear.int4_weight_only_linear(x[a:b], packed[e], scale[e], 32)
        )


def test_bad_arguments_are_refused_by_name():
    gen = seeded_generator()
    x, packed, scale = operands(gen, 4, 64, 256, 32, experts=2)
    offsets = torch.tensor([0, 1, 4], dtype=torch.int32)
    with pytest.raises(QuantizationError, match="int4 linear weight_packed.*int32"):
        int4_mxfp8_linear.int4_weight_only_linear(x, packed[0].float(), scale[0], 32)
    with pytest.raises(QuantizationError, match="do not match"):
        int4_mxfp8_linear.int4_weight_only_linear(x[:, :128], packed[0], scale[0], 32)
    with pytest.raises(QuantizationError, match="group_size 48 must be a positive divisor of K = 256"):
        int4_mxfp8_linear.int4_weight_only_linear(x, packed[0], scale[0], 48)
    with pytest.raises(QuantizationError, match="int4 linear weight_scale"):
        int4_mxfp8_linear.int4_weight_only_linear(x, packed[0], scale[0, :, :4], 32)
    with pytest.raises(QuantizationError, match=r"weight_packed must be \[N, K/8\]"):
        int4_mxfp8_linear.int4_weight_only_linear(x, packed, scale, 32)
    with pytest.raises(QuantizationError, match=r"weight_packed must be \[E, N, K/8\]"):
        int4_mxfp8_linear.int4_grouped_weight_only_linear(x, packed[0], scale[0], offsets, 32)
    with pytest.raises(QuantizationError, match="offsets must be int32"):
        int4_mxfp8_linear.int4_grouped_weight_only_linear(x, packed, scale, offsets.long(), 32)
    with pytest.raises(QuantizationError, match="must rise from 0 to the 4 routed rows"):
        int4_mxfp8_linear.int4_grouped_weight_only_linear(
            x, packed, scale, torch.tensor([0, 3, 2], dtype=torch.int32), 32
        )


def test_the_kernel_takes_only_what_it_reads():
    """CPU tensors never take it; the group must be whole words dividing K (checked with a CUDA-free
    stand-in for the device test)."""
    from skyq.rollout.kernels import triton_int4_gemv

    gen = seeded_generator()
    x, packed, scale = operands(gen, 2, 32, 256, 32)
    assert not int4_mxfp8_linear.int4_kernel_takes(x, packed, scale, 32)
    assert triton_int4_gemv.supports(32, 256) and triton_int4_gemv.supports(256, 256)
    assert not triton_int4_gemv.supports(4, 256)  # codes of one word under two scales
    assert not triton_int4_gemv.supports(96, 256)  # does not divide K
    assert not triton_int4_gemv.supports(32, 260)  # K not whole words


def test_past_64_rows_only_small_products_stay_on_the_kernel():
    """The dense INT4 / MXFP8 decode linears' choice: the kernel up to 64 rows at any weight; past
    64 rows while rows x N x K <= 3e8 (small_moe's o 1024 x 1024 at 256 rows, its q/k/v 1536 x 1024
    at 128), else the weight dequantized once for bf16's GEMM (the GPU tests check both outputs)."""
    from skyq.rollout.kernels import triton_int4_gemv as k

    assert k.KERNEL_MAX_ROWS == 64 and k.KERNEL_MAX_WORK == 300_000_000
    assert not k.dequantizes_first(64, 12288, 2048) and k.dequantizes_first(65, 12288, 2048)
    assert not k.dequantizes_first(256, 1024, 1024) and k.dequantizes_first(257, 1024, 1024 + 128)
    assert not k.dequantizes_first(128, 1536, 1024) and k.dequantizes_first(256, 1536, 1024)
    assert not k.dequantizes_first(65, 2048, 2048) and k.dequantizes_first(65, 4096, 2048)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_the_kernel_matches_the_reference_under_the_triton_interpreter():
    run_under_interpreter(__file__, "interpreter: int4 gemv matches")


def _interpreter_main() -> None:
    from tests.interpreter_run import kernels_on_cpu, report
    from tests.quant.test_kernel_dispatch_gemv import _bf16_interpreter_dot

    kernels_on_cpu()
    _bf16_interpreter_dot()
    from skyq.quant.kernels import triton_int4_dequant
    from skyq.rollout.kernels import triton_int4_gemv as kernels

    gen = seeded_generator()
    failures = []
    # dense: N tails, a K tail inside a K step (264 = 2 x 128 + 8), split K, several row tiles, groups of
    # one word, 32, 128 and a whole row (channel scales)
    for m, n, k, group, config in (
        (1, 200, 256, 32, None),
        (5, 100, 384, 128, (16, 64, 128, 2, 4, 3)),
        (20, 130, 264, 8, (32, 32, 128, 3, 4, 3)),
        (40, 96, 512, 32, (16, 64, 128, 2, 4, 3)),
        (70, 64, 256, 256, (32, 64, 256, 1, 4, 3)),
    ):
        x, packed, scale = operands(gen, m, n, k, group)
        got = kernels.linear(x, packed, scale, group_size=group, config=config)
        if got.shape != (m, n) or not within_tolerance(got, x, packed, scale, group):
            failures.append(("dense", m, n, k, group, config))
    # grouped: an expert without rows, one spanning several row tiles, row tiles spread (MT 2)
    x, packed, scale = operands(gen, 45, 96, 256, 32, experts=4)
    offsets = torch.tensor([0, 7, 7, 40, 45], dtype=torch.int32)
    for config in (None, (16, 64, 128, 2, 4, 3), (16, 32, 256, 1, 4, 3)):
        got = kernels.linear_grouped(x, packed, scale, offsets, group_size=32, config=config)
        for e, (a, b) in enumerate(zip(offsets.tolist(), offsets.tolist()[1:])):
            if b > a and not within_tolerance(got[a:b], x[a:b], packed[e], scale[e], 32):
                failures.append(("grouped", e, config))
    # exact: one nonzero activation a row, so each output is one rounded product in any order: the
    # kernel equals the reference bit for bit (a wrong nibble, shift or scale index shows)
    m, n, k = 24, 64, 384
    _, packed, scale = operands(gen, m, n, k, 32)
    x = torch.zeros(m, k, dtype=torch.bfloat16)
    x[torch.arange(m), torch.randint(0, k, (m,), generator=gen)] = torch.randn(m, generator=gen).to(
        torch.bfloat16
    )
    exact = int4_mxfp8_linear.int4_weight_only_linear_reference(x, packed, scale, 32)
    if not torch.equal(kernels.linear(x, packed, scale, group_size=32, config=(16, 64, 128, 2, 4, 3)), exact):
        failures.append("one-term exact")
    # the dequantizer on the same register path: int4.dequantize_packed's bits (N and K tails inside
    # a tile, groups of one word to a whole row, a stack of experts)
    for shape, group in (((70, 264), 8), ((33, 512), 32), ((3, 40, 384), 128), ((5, 1024), 1024)):
        w = torch.randn(shape, generator=gen) * 10.0 ** (torch.rand(*shape[:-1], 1, generator=gen) * 3 - 2)
        q, sc = int4.quantize(w, group_size=group)
        packed = int4.pack(q)
        n, k = shape[-2:]
        got = triton_int4_dequant.dequantize(
            packed.reshape(-1, n, k // 8), sc.reshape(-1, n, k // group), n, k, group
        )
        if not torch.equal(got.reshape(shape), int4.dequantize_packed(packed, sc, (n, k), group_size=group)):
            failures.append(("dequantize", shape, group))
    report("int4 gemv", failures)


if __name__ == "__main__" and "--interpret" in sys.argv:
    _interpreter_main()
