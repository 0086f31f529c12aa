"""The INT4 weight-only decode linear (`triton_int4_gemv`) on the GPU, by default routed to the
Gluon kernel on sm_90 (`gluon=True`) and with `triton_int4_gemv.GLUON` off (the Triton kernel):
dense and grouped against the float64 product of x and the dequantized weight (bound: bf16 output
rounding plus 2^-16 of |x| @ |W|^T for fp32 sums in another order), bit for bit where no summation
order can matter, the Triton kernel's PTX dequantization (sm_90) giving its Triton formulation's
bits, captured in a CUDA graph."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")  # the kernel modules import it at their top

from skyq.quant.kernels import dispatch, triton_int4_dequant  # noqa: E402
from skyq.rollout.kernels import int4_mxfp8_linear, triton_int4_gemv  # noqa: E402
from tests.gpu.conftest import replayed  # noqa: E402
from tests.quant.test_int4_gemv import operands, within_tolerance  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (and Triton)"),
]


def _cuda(*ts):
    return [t.cuda() for t in ts]


@pytest.fixture(params=[True, False], ids=["gluon", "triton"])
def gluon(request, monkeypatch):
    monkeypatch.setattr(triton_int4_gemv, "GLUON", request.param)
    assert triton_int4_gemv.gluon_applies(torch.empty(1, device="cuda")) == request.param
    return request.param


@pytest.mark.parametrize(
    ("m", "n", "k", "group"),
    [(1, 5120, 2048, 32), (16, 2048, 4096, 128), (33, 12288, 2048, 32), (64, 2048, 6144, 32),
     (100, 200, 264, 8), (7, 96, 768, 768), (256, 1536, 1024, 32)],
)  # fmt: skip
@pytest.mark.parametrize("config", [None, (16, 32, 128, 4, 4, 3), (64, 128, 256, 1, 8, 3)])
def test_dense_kernel_matches_the_dequantized_product(gen, gluon, m, n, k, group, config):
    x, packed, scale = _cuda(*operands(gen, m, n, k, group))
    got = triton_int4_gemv.linear(x, packed, scale, group_size=group, config=config)
    assert got.shape == (m, n)
    assert within_tolerance(got.cpu(), x.cpu(), packed.cpu(), scale.cpu(), group)


@pytest.mark.parametrize(("m", "n", "k"), [(1, 5120, 2048), (16, 2048, 4096), (64, 1536, 2048)])
def test_the_ptx_dequantization_gives_the_triton_formulations_bits(gen, monkeypatch, m, n, k):
    monkeypatch.setattr(triton_int4_gemv, "GLUON", False)
    x, packed, scale = _cuda(*operands(gen, m, n, k, 32))
    assert triton_int4_dequant.asm(x)
    monkeypatch.setattr(triton_int4_gemv, "ASM_MAX_ROWS", 64)  # every row tile here
    with_asm = triton_int4_gemv.linear(x, packed, scale, group_size=32)
    monkeypatch.setattr(triton_int4_dequant, "ASM", False)
    assert not triton_int4_dequant.asm(x)
    assert torch.equal(triton_int4_gemv.linear(x, packed, scale, group_size=32), with_asm)


def test_one_term_rows_equal_the_reference_bit_for_bit(gen, gluon):
    m, n, k = 48, 1024, 2048
    _, packed, scale = _cuda(*operands(gen, m, n, k, 32))
    x = torch.zeros(m, k, dtype=torch.bfloat16, device="cuda")
    cols = torch.randint(0, k, (m,), generator=gen)
    x[torch.arange(m), cols.cuda()] = torch.randn(m, generator=gen).to(torch.bfloat16).cuda()
    exact = int4_mxfp8_linear.int4_weight_only_linear_reference(x, packed, scale, 32)
    assert torch.equal(triton_int4_gemv.linear(x, packed, scale, group_size=32), exact)


@pytest.mark.parametrize(
    ("tokens", "experts", "top_k", "n", "k"),
    [(64, 128, 8, 1536, 2048), (9, 16, 2, 2048, 768), (256, 32, 4, 1536, 1024), (96, 32, 4, 200, 288)],
)
def test_grouped_kernel_takes_each_experts_rows(gen, gluon, tokens, experts, top_k, n, k):
    rows = tokens * top_k
    x, packed, scale = _cuda(*operands(gen, rows, n, k, 32, experts=experts))
    counts = torch.bincount(torch.randint(0, experts - 1, (rows,), generator=gen), minlength=experts)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)]).to(torch.int32).cuda()
    got = int4_mxfp8_linear.int4_grouped_weight_only_linear(x, packed, scale, offsets, 32)
    bounds = offsets.tolist()
    for e, (a, b) in enumerate(zip(bounds, bounds[1:])):
        if b > a:
            assert within_tolerance(got[a:b].cpu(), x[a:b].cpu(), packed[e].cpu(), scale[e].cpu(), 32), e


def test_a_captured_launch_replays_the_eager_bits(gen, gluon):
    x, packed, scale = _cuda(*operands(gen, 8, 2048, 2048, 32))
    eager = int4_mxfp8_linear.int4_weight_only_linear(x, packed, scale, 32)
    torch.cuda.synchronize()
    assert torch.equal(
        replayed(lambda: int4_mxfp8_linear.int4_weight_only_linear(x, packed, scale, 32)), eager
    )


@pytest.mark.parametrize("m", [65, 256])
def test_more_rows_than_the_kernel_takes_multiply_the_dequantized_weight(gen, m):
    """Past `KERNEL_MAX_ROWS` rows, and `KERNEL_MAX_WORK` rows x N x K, the dense linear dequantizes
    the weight once (the decode kernels' register dequantization) and runs bf16's GEMM: the float64
    product of the dequantized weight within bf16 rounding (cuBLAS may reduce in bf16), captured in
    a graph (no host sync)."""
    x, packed, scale = _cuda(*operands(gen, m, 4096, 2048, 32))
    assert triton_int4_gemv.dequantizes_first(m, 4096, 2048)
    got = int4_mxfp8_linear.int4_weight_only_linear(x, packed, scale, 32)
    w = dispatch.dequantize_int4_packed(packed, scale, (4096, 2048), group_size=32).double()
    ref, mag = x.double() @ w.T, x.double().abs() @ w.abs().T
    assert bool(((got.double() - ref).abs() <= ref.abs() * 2.0**-7 + mag * 2.0**-8).all())
    assert torch.equal(replayed(lambda: int4_mxfp8_linear.int4_weight_only_linear(x, packed, scale, 32)), got)
