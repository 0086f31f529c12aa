"""Fake-quant STEs: forward is dequantize(quantize(w)) bit for bit, backward is the identity."""

from __future__ import annotations

import pytest
import torch

from skyq.quant import fp8_blockwise, int4, mxfp8
from skyq.quant.errors import QuantizationError
from skyq.quant.fake_quant import (
    fake_quant_fp8_activation,
    fake_quant_fp8_blockwise,
    fake_quant_int4,
    fake_quant_mxfp8,
)

INT_VIEW = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


def reference_fp8(w, block_size=(128, 128), pow2_scale=False):
    q, s = fp8_blockwise.quantize(w, block_size=block_size, pow2_scale=pow2_scale)
    return fp8_blockwise.dequantize(q, s, block_size=block_size, dtype=w.dtype)


def reference_mxfp8(w):
    return mxfp8.dequantize(*mxfp8.quantize(w), dtype=w.dtype)


def reference_int4(w, group_size, grid):
    q, s = int4.quantize(w, group_size=group_size, grid=grid)
    return int4.dequantize(q, s, group_size=group_size, dtype=w.dtype)


def reference_act(x, tile=128, pow2_scale=False):
    q, s = fp8_blockwise.quantize_activation(x, tile=tile, pow2_scale=pow2_scale)
    return fp8_blockwise.dequantize_activation(q, s, tile=tile, dtype=x.dtype)


CASES = {
    "fp8_blockwise": (lambda w: fake_quant_fp8_blockwise(w, (128, 128), False), reference_fp8),
    "fp8_blockwise_pow2_64": (
        lambda w: fake_quant_fp8_blockwise(w, (64, 64), True),
        lambda w: reference_fp8(w, (64, 64), True),
    ),
    "mxfp8": (fake_quant_mxfp8, reference_mxfp8),
    "int4_kimi_32": (lambda w: fake_quant_int4(w, 32, "kimi"), lambda w: reference_int4(w, 32, "kimi")),
    "int4_rtn_128": (lambda w: fake_quant_int4(w, 128, "rtn"), lambda w: reference_int4(w, 128, "rtn")),
    "fp8_activation": (fake_quant_fp8_activation, reference_act),
}


def assert_bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(a.contiguous().view(INT_VIEW[a.dtype]), b.contiguous().view(INT_VIEW[b.dtype]))


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(
    "shape,layout", [((256, 384), "contiguous"), ((2, 130, 256), "transposed"), ((96, 128), "strided")]
)
def test_forward_is_dequantize_of_quantize_bit_for_bit(make_weight, case, dtype, shape, layout):
    fake, reference = CASES[case]
    w = make_weight(shape, dtype, layout)
    out = fake(w)
    assert out.dtype == w.dtype
    assert_bitwise_equal(out, reference(w))


@pytest.mark.parametrize("case", CASES)
def test_gradient_passes_straight_through(make_weight, gen, case):
    fake, _ = CASES[case]
    w = make_weight((128, 256), torch.bfloat16).requires_grad_(True)
    upstream = torch.randn(128, 256, generator=gen).to(torch.bfloat16)
    fake(w).backward(upstream)
    assert w.grad is not None and w.grad.dtype == w.dtype
    assert_bitwise_equal(w.grad, upstream)


def test_gradient_flows_through_a_transposed_parameter_view(make_weight, gen):
    p = make_weight((256, 128), torch.float32).requires_grad_(True)
    upstream = torch.randn(128, 256, generator=gen)
    fake_quant_int4(p.t(), 32).backward(upstream)
    assert torch.equal(p.grad, upstream.t())


def test_straight_through_composes_with_a_matmul(make_weight, gen):
    w = make_weight((64, 128), torch.float32).requires_grad_(True)
    x = torch.randn(8, 128, generator=gen)
    (x @ fake_quant_mxfp8(w).t()).sum().backward()
    assert torch.equal(w.grad, x.sum(0, keepdim=True).expand(64, 128))


@pytest.mark.parametrize("case", CASES)
def test_non_finite_weights_are_refused_in_the_forward(case):
    fake, _ = CASES[case]
    w = torch.ones(128, 128, requires_grad=True)
    bad = w * torch.where(torch.arange(128) == 3, float("nan"), 1.0)
    with pytest.raises(QuantizationError, match="NaN"):
        fake(bad)


def test_fake_quant_names_the_tensor_and_refuses_impossible_shapes():
    w = torch.ones(4, 100)
    with pytest.raises(QuantizationError, match=r"layers\.0\.experts\.1\.up_proj: MXFP8 needs K % 32 == 0"):
        fake_quant_mxfp8(w, name="layers.0.experts.1.up_proj")
    with pytest.raises(QuantizationError, match=r"K % group_size == 0, but K = 100"):
        fake_quant_int4(w, 128)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("case", CASES)
def test_cuda_forward_and_gradient_match_cpu(make_weight, gen, case):
    fake, _ = CASES[case]
    w = make_weight((3, 512, 1024), torch.bfloat16)
    upstream = torch.randn(w.shape, generator=gen).to(torch.bfloat16)
    wc = w.cuda().requires_grad_(True)
    out = fake(wc)
    out.backward(upstream.cuda())
    assert_bitwise_equal(out.detach().cpu(), fake(w))
    assert_bitwise_equal(wc.grad.cpu(), upstream)
