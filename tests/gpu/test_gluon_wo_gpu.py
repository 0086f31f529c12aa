"""The Gluon weight-only decode kernels (`gluon_wo_gemv`, sm_90) on the GPU with their tilings and
sweep variants: INT4 and MXFP8, dense and grouped, against the float64 product of x and the
dequantized weight (the bounds of tests/quant/test_int4_gemv.py and test_mxfp8_gemv.py), and bit for
bit where no summation order can matter (one nonzero activation a row): INT4 against the Triton
INT4 kernel, MXFP8 against the reference, E8M0 scales from 2^-127 to 2^100 included."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")  # the kernel modules import it at their top

from skyq.quant import mxfp8  # noqa: E402
from skyq.quant.kernels import dispatch  # noqa: E402
from skyq.rollout.kernels import gluon_wo_gemv, int4_mxfp8_linear, triton_fp8_gemv, triton_int4_gemv  # noqa: E402
from tests.gpu.conftest import replayed  # noqa: E402
from tests.quant import test_mxfp8_gemv as mx  # noqa: E402
from tests.quant.test_int4_gemv import operands, within_tolerance  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (and Triton)"),
]


@pytest.mark.parametrize(
    ("m", "n", "k", "group"),
    [(1, 5120, 2048, 32), (16, 2048, 4096, 128), (33, 1536, 1024, 32), (5, 200, 264, 8),
     (1, 12288, 2048, 32), (64, 12288, 2048, 32), (12, 96, 768, 768), (256, 2048, 6144, 32)],
)  # fmt: skip
@pytest.mark.parametrize(
    "config", [None, (8, 32, 128, 4, 2, 1), (32, 16, 64, 2, 1, 2), (64, 64, 128, 1, 4, 2)]
)
def test_dense_matches_the_dequantized_product(gen, m, n, k, group, config):
    x, packed, scale = (t.cuda() for t in operands(gen, m, n, k, group))
    got = gluon_wo_gemv.linear(
        x, packed, scale, group_size=group, sms=132, counters=triton_fp8_gemv._arrival_counters, config=config
    )
    assert got.shape == (m, n)
    assert within_tolerance(got.cpu(), x.cpu(), packed.cpu(), scale.cpu(), group)


def test_one_term_rows_equal_the_triton_kernel_bit_for_bit(gen):
    m, n, k = 16, 1024, 2048
    _, packed, scale = (t.cuda() for t in operands(gen, m, n, k, 32))
    x = torch.zeros(m, k, dtype=torch.bfloat16, device="cuda")
    x[torch.arange(m), torch.randint(0, k, (m,), generator=gen).cuda()] = 1.5
    got = gluon_wo_gemv.linear(
        x, packed, scale, group_size=32, sms=132, counters=triton_fp8_gemv._arrival_counters
    )
    assert torch.equal(got, triton_int4_gemv.linear(x, packed, scale, group_size=32))


@pytest.mark.parametrize("rows", [1, 40, 120, 400])  # 8-, 16- and 32-row tiles by the mean an expert
@pytest.mark.parametrize("config", [None, (16, 16, 128, 1, 1, 4), (64, 32, 128, 1, 2, 1)])
def test_grouped_matches_each_experts_product(gen, rows, config):
    experts, n, k = 8, 768, 2048
    x, packed, scale = (t.cuda() for t in operands(gen, rows, n, k, 32, experts=experts))
    counts = torch.bincount(torch.randint(0, experts - 1, (rows,), generator=gen), minlength=experts)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)]).to(torch.int32).cuda()
    got = gluon_wo_gemv.linear_grouped(x, packed, scale, offsets, group_size=32, sms=132, config=config)
    bounds = offsets.tolist()
    for e, (a, b) in enumerate(zip(bounds, bounds[1:])):
        if b > a:
            assert within_tolerance(got[a:b].cpu(), x[a:b].cpu(), packed[e].cpu(), scale[e].cpu(), 32), e


@pytest.mark.parametrize(
    ("m", "n", "k"),
    [(1, 5120, 2048), (16, 2048, 4096), (33, 1536, 1024), (5, 200, 288), (64, 12288, 2048), (256, 2048, 768)],
)
@pytest.mark.parametrize("config", [None, (8, 32, 128, 4, 2, 1), (32, 16, 64, 2, 1, 2)])
def test_mxfp8_dense_matches_the_dequantized_product(gen, m, n, k, config):
    x, q, s = (t.cuda() for t in mx.operands(gen, m, n, k))
    got = gluon_wo_gemv.linear_mxfp8(
        x, q, s, sms=132, counters=triton_fp8_gemv._arrival_counters, config=config
    )
    assert got.shape == (m, n)
    assert mx.within_tolerance(got.cpu(), x.cpu(), q.cpu(), s.cpu())


@pytest.mark.parametrize("m", [65, 256])
def test_mxfp8_more_rows_than_the_kernel_takes_multiply_the_dequantized_weight(gen, m):
    """Past `KERNEL_MAX_ROWS` rows, and `KERNEL_MAX_WORK` rows x N x K, the dense MXFP8 linear
    dequantizes the weight once and runs bf16's GEMM: bit for bit `F.linear` on the reference's bf16
    weight (the prefill's product), and the same bits captured in a graph inside a deferred-check
    scope (no host sync), as the engine's steps run it."""
    x, q, s = (t.cuda() for t in mx.operands(gen, m, 4096, 2048))
    assert triton_int4_gemv.dequantizes_first(m, 4096, 2048)
    got = int4_mxfp8_linear.mxfp8_weight_only_linear(x, q, s)
    w = mxfp8.dequantize(q.cpu(), s.cpu(), dtype=torch.bfloat16).cuda()
    assert torch.equal(got, torch.nn.functional.linear(x, w))
    with dispatch.deferred_finite_checks():
        out = replayed(lambda: int4_mxfp8_linear.mxfp8_weight_only_linear(x, q, s))
    assert torch.equal(out, got)


def test_a_small_weight_stays_on_the_kernel_at_any_rows(gen):
    """A small weight (256 rows x N x K at most `KERNEL_MAX_WORK`) takes the decode kernel at 256
    rows too, INT4 and MXFP8 (the kernels' own bits)."""
    assert not triton_int4_gemv.dequantizes_first(256, 1024, 1024)
    x, q, s = (t.cuda() for t in mx.operands(gen, 256, 1024, 1024))
    kernel = gluon_wo_gemv.linear_mxfp8(x, q, s, sms=132, counters=triton_fp8_gemv._arrival_counters)
    assert torch.equal(int4_mxfp8_linear.mxfp8_weight_only_linear(x, q, s), kernel)
    x, packed, scale = (t.cuda() for t in operands(gen, 256, 1024, 1024, 32))
    kernel = triton_int4_gemv.linear(x, packed, scale, group_size=32)
    assert torch.equal(int4_mxfp8_linear.int4_weight_only_linear(x, packed, scale, 32), kernel)


def test_mxfp8_one_term_rows_equal_the_reference_bit_for_bit(gen):
    """Each output one rounded product of an activation and one weight: the weights' bits are the
    reference's, E8M0 bytes 0 (2^-127, an fp32 subnormal), 1 and 227 (2^100) included."""
    m, n, k = 16, 1024, 2048
    _, q, s = mx.operands(gen, m, n, k)
    s[0, :] = 0
    s[1, :] = 1
    s[2, :] = 227
    s[3, ::2] = 0
    x = torch.zeros(m, k, dtype=torch.bfloat16)
    x[torch.arange(m), torch.randint(0, k, (m,), generator=gen)] = torch.randn(m, generator=gen).to(
        torch.bfloat16
    )
    exact = int4_mxfp8_linear.mxfp8_weight_only_linear_reference(x, q, s)
    got = int4_mxfp8_linear.mxfp8_weight_only_linear(x.cuda(), q.cuda(), s.cuda())
    assert torch.equal(got.cpu(), exact)
    w = mxfp8.dequantize(q, s, dtype=torch.bfloat16)
    eye = torch.eye(k, dtype=torch.bfloat16).cuda()  # the dequantized weight itself, column by column
    for lo in range(0, k, 512):
        cols = gluon_wo_gemv.linear_mxfp8(eye[lo : lo + 512], q.cuda(), s.cuda(), sms=132,
                                          counters=triton_fp8_gemv._arrival_counters)  # fmt: skip
        assert torch.equal(cols.T.cpu(), w[:, lo : lo + 512])


@pytest.mark.parametrize("rows", [1, 40, 120, 400])
@pytest.mark.parametrize("config", [None, (16, 16, 128, 1, 1, 4)])
def test_mxfp8_grouped_matches_each_experts_product(gen, rows, config):
    experts, n, k = 8, 768, 2048
    x, q, s = (t.cuda() for t in mx.operands(gen, rows, n, k, experts=experts))
    counts = torch.bincount(torch.randint(0, experts - 1, (rows,), generator=gen), minlength=experts)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)]).to(torch.int32).cuda()
    got = gluon_wo_gemv.linear_grouped_mxfp8(x, q, s, offsets, sms=132, config=config)
    bounds = offsets.tolist()
    for e, (a, b) in enumerate(zip(bounds, bounds[1:])):
        if b > a:
            assert mx.within_tolerance(got[a:b].cpu(), x[a:b].cpu(), q[e].cpu(), s[e].cpu()), e
    assert (
        torch.equal(int4_mxfp8_linear.mxfp8_grouped_weight_only_linear(x, q, s, offsets), got)
        or config is not None
    )
