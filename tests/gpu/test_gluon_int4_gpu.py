"""The Gluon INT4 decode kernel (`gluon_int4_gemv`, sm_90) on the GPU with its tilings and sweep
variants, against the float64 product of x and the dequantized weight (the bound of
tests/quant/test_int4_gemv.py), and bit for bit against the Triton INT4 kernel where no summation
order can matter (one nonzero activation a row)."""

from __future__ import annotations

import pytest
import torch

from skyq.quant.kernels import gluon_int4_gemv, triton_fp8_gemv, triton_int4_gemv
from tests.quant.test_int4_gemv import operands, within_tolerance

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
    got = gluon_int4_gemv.linear(
        x, packed, scale, group_size=group, sms=132, counters=triton_fp8_gemv._arrival_counters, config=config
    )
    assert got.shape == (m, n)
    assert within_tolerance(got.cpu(), x.cpu(), packed.cpu(), scale.cpu(), group)


def test_one_term_rows_equal_the_triton_kernel_bit_for_bit(gen):
    m, n, k = 16, 1024, 2048
    _, packed, scale = (t.cuda() for t in operands(gen, m, n, k, 32))
    x = torch.zeros(m, k, dtype=torch.bfloat16, device="cuda")
    x[torch.arange(m), torch.randint(0, k, (m,), generator=gen).cuda()] = 1.5
    got = gluon_int4_gemv.linear(
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
    got = gluon_int4_gemv.linear_grouped(x, packed, scale, offsets, group_size=32, sms=132, config=config)
    bounds = offsets.tolist()
    for e, (a, b) in enumerate(zip(bounds, bounds[1:])):
        if b > a:
            assert within_tolerance(got[a:b].cpu(), x[a:b].cpu(), packed[e].cpu(), scale[e].cpu(), 32), e
