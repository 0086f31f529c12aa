"""The FP8 x FP8 decode linear (`triton_fp8_w8a8`) on the GPU: dense and grouped against the float64
product of the dequantized codes (bound: bf16 output rounding plus 2^-12 of |x| @ |W|^T for the FP8
tensor core's accumulation within a block),
bit for bit where no summation order can matter, captured in a CUDA graph; and the engine's large
decode step on it."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")  # the kernel modules import it at their top

from skyq.rollout.kernels import fp8_linear, triton_fp8_w8a8  # noqa: E402
from tests.quant.test_w8a8 import _operands, within_tolerance  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not (torch.cuda.is_available() and fp8_linear.w8a8_kernel_available(torch.device("cuda"))),
        reason="needs a CUDA GPU with e4m3 tensor cores (sm_89+) and Triton",
    ),
]


def _cuda(*ts):
    return [t.cuda() for t in ts]


@pytest.mark.parametrize(
    ("m", "n", "k"),
    [
        (1, 5120, 2048),
        (17, 2048, 4096),
        (65, 5120, 2048),
        (128, 1536, 2048),
        (300, 2048, 768),
        (1024, 512, 320),
    ],
)
@pytest.mark.parametrize("config", [None, (32, 64, 2, 4, 3), (128, 128, 1, 8, 3)])
def test_dense_kernel_matches_the_dequantized_product(gen, m, n, k, config):
    xq, xs, q, s = _cuda(*_operands(gen, m, n, k))
    got = triton_fp8_w8a8.linear(xq, xs, q, s, config=config)
    assert got.shape == (m, n) and within_tolerance(
        got.cpu(), *(t.cpu() for t in (xq, xs, q, s)), sum_bits=12
    )


@pytest.mark.parametrize(
    ("tokens", "experts", "top_k", "n", "k"),
    [(512, 128, 8, 1536, 2048), (40, 8, 2, 2048, 768), (300, 32, 4, 192, 320)],
)
def test_grouped_kernel_gathers_each_experts_rows(gen, tokens, experts, top_k, n, k):
    xq, xs, q, s = _cuda(*_operands(gen, tokens, n, k, experts=experts))
    index = torch.stack(
        [torch.randperm(experts - 1, generator=gen)[:top_k] for _ in range(tokens)]
    )  # last: no rows
    flat = index.flatten()
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=experts)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)]).to(torch.int32).cuda()
    token = (order // top_k).cuda()
    got = fp8_linear.fp8_grouped_w8a8_linear(xq, xs, q, s, offsets, index=token)
    ref = fp8_linear.fp8_grouped_w8a8_linear(*(t.cpu() for t in (xq, xs, q, s, offsets)), index=token.cpu())
    bounds = offsets.tolist()
    for e in range(experts):
        a, b = bounds[e], bounds[e + 1]
        if b > a:
            rows = token[a:b].cpu()
            assert within_tolerance(
                got[a:b].cpu(), xq.cpu()[rows], xs.cpu()[rows], q[e].cpu(), s[e].cpu(), sum_bits=12
            ), e
    assert float((got.cpu().float() - ref.float()).norm() / ref.float().norm()) < 1e-2


def test_two_term_rows_with_power_of_two_scales_are_exact(gen):
    """Two nonzero activations a row in two different 128-column blocks (so each block's MMA sum is one
    exact product; within a block the tensor core's adder keeps fewer bits than fp32), power-of-two
    scales: one rounding in any order, so the kernel equals the reference bit for bit."""
    xq, xs, q, s = _operands(gen, 64, 1024, 2048, pow2=True)
    codes = torch.zeros(64, 2048)
    for row in range(64):
        blocks = torch.randperm(16, generator=gen)[:2]
        cols = blocks * 128 + torch.randint(0, 128, (2,), generator=gen)
        codes[row, cols] = torch.randint(1, 8, (2,), generator=gen).float()
    xq = codes.to(torch.float8_e4m3fn)
    got = fp8_linear.fp8_w8a8_linear(*_cuda(xq, xs, q, s))
    assert torch.equal(got.cpu(), fp8_linear.fp8_w8a8_linear_reference(xq, xs, q, s))


def test_a_captured_grouped_call_replays_the_eager_bits(gen):
    xq, xs, q, s = _cuda(*_operands(gen, 256, 1536, 2048, experts=16))
    offsets = torch.tensor([0, *range(32, 512 + 1, 32)], dtype=torch.int32).cuda()  # 16 experts x 32 rows
    token = torch.randint(0, 256, (512,), generator=gen).cuda()
    eager = fp8_linear.fp8_grouped_w8a8_linear(xq, xs, q, s, offsets, index=token)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fp8_linear.fp8_grouped_w8a8_linear(xq, xs, q, s, offsets, index=token)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fp8_linear.fp8_grouped_w8a8_linear(xq, xs, q, s, offsets, index=token)
    graph.replay()
    assert torch.equal(out, eager)
