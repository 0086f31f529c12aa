"""FP8 weight-only decode linear on the GPU: the Triton kernel against the trainer's weight.

The kernel multiplies by `dequantize(q, s, bfloat16)`, the weight the trainer and the engine's
prefill path use, so the reference is `x.float() @ dequantize(q, s, bfloat16).float().T` and what
is left is fp32 summation order (tiles, tensor-core MMA, split-K): bounded by 2^-17 of
`|x| @ |W|^T`, plus one rounding of the result to bf16 (2^-8 relative) for bf16 outputs. The
kernel's former numerics (block scales applied to fp32 partial sums, i.e. the fp32-dequantized
weight) are ~2e-4 of `|x| @ |W|^T` away at their worst (CPU estimate), so the bound tells them apart.
Fresh random data each run (seed printed). The kernel allocates its output with torch.empty, so
an unwritten element shows up as garbage or NaN: every element is checked against the bound.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from skyq.quant import fp8_blockwise
from skyq.quant.kernels import dispatch
from skyq.rollout.kernels import fp8_linear

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or importlib.util.find_spec("triton") is None,
        reason="needs CUDA and Triton",
    ),
]

# (N, K, block): Qwen3-30B-A3B q/k/o and expert gate/down, odd N and K, a smaller block.
SHAPES = [
    (4096, 2048, (128, 128)),
    (512, 2048, (128, 128)),
    (2048, 4096, (128, 128)),
    (768, 2048, (128, 128)),
    (2048, 768, (128, 128)),
    (301, 277, (128, 128)),
    (1000, 1030, (64, 32)),
]

ORDER = 2.0**-17
"""fp32 summation-order tolerance, relative to `|x| @ |W|^T`."""


def _weight_and_input(gen, n, k, block, m):
    w = torch.randn(n, k, generator=gen) * torch.logspace(-3, 1, n).unsqueeze(1)
    q, s = fp8_blockwise.quantize(w.cuda(), block_size=block)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16).cuda()
    return q, s, x


def _bf16_weight_product(x, q, s, block):
    """(`x.float() @ W.float().T`, `|x| @ |W|^T`) for W = dequantize(q, s, bfloat16)."""
    w = fp8_blockwise.dequantize(q, s, block_size=block, dtype=torch.bfloat16).float()
    return x.float() @ w.T, x.float().abs() @ w.abs().T


def _bounded(got, x, q, s, block):
    ref, mag = _bf16_weight_product(x, q, s, block)
    rounding = 2.0**-8 if got.dtype == torch.bfloat16 else 0.0
    bound = ref.abs() * rounding + ORDER * mag
    err = (got.float() - ref).abs()
    return bool((err <= bound).all()), float((err / bound.clamp_min(1e-30)).max())


@pytest.mark.parametrize(("n", "k", "block"), SHAPES)
@pytest.mark.parametrize("m", [1, 3, 16, 17, 32, 64])
def test_fp8_gemv_matches_the_bf16_weight_product(gen, n, k, block, m):
    q, s, x = _weight_and_input(gen, n, k, block, m)
    got = fp8_linear.fp8_weight_only_linear(x, q, s, block_size=block)
    torch.cuda.synchronize()
    assert got.shape == (m, n) and got.dtype == torch.bfloat16
    assert bool(torch.isfinite(got).all()), "an output element was not written (or is not finite)"
    ok, worst = _bounded(got, x, q, s, block)
    assert ok, f"error reaches {worst:.3g} of the bound"


@pytest.mark.parametrize(("n", "k", "block"), SHAPES)
@pytest.mark.parametrize("m", [1, 17, 64])
def test_fp8_gemv_accumulator_is_the_bf16_weight_product_up_to_summation_order(gen, n, k, block, m):
    """With fp32 activations (bf16 values) the kernel writes its fp32 accumulator unrounded: within
    summation noise of the bf16-weight product, and on average far closer to it than the
    fp32-weight product is (that one differs by the bf16 rounding of every weight)."""
    from skyq.rollout.kernels import triton_fp8_gemv as kern

    q, s, x = _weight_and_input(gen, n, k, block, m)
    got = kern.linear(x.float(), q, s, block_size=block)
    torch.cuda.synchronize()
    assert got.dtype == torch.float32
    ok, worst = _bounded(got, x, q, s, block)
    assert ok, f"error reaches {worst:.3g} of the bound"
    ref, _ = _bf16_weight_product(x, q, s, block)
    fp32_weight = x.float() @ fp8_blockwise.dequantize(q, s, block_size=block, dtype=torch.float32).T
    assert float((got - ref).abs().mean()) <= 0.1 * float((fp32_weight - ref).abs().mean())


@pytest.mark.parametrize(("n", "k", "block"), SHAPES)
@pytest.mark.parametrize("m", [1, 16, 64])
def test_fp8_gemv_agrees_with_the_prefill_path(gen, n, k, block, m, monkeypatch):
    """The engine's prefill (and the trainer) multiply by the dequantized bf16 weight in a bf16
    GEMM: `F.linear(x, dequantize(q, s, bfloat16))`. With fp32 accumulation there too (torch lets
    cuBLAS reduce split-K partials in bf16 by default; off here, as that is a rounding of its own),
    the two differ only by summation order: at most one bf16 step apart, and bit-equal almost
    everywhere (CPU estimate of the fp32-order flips: ~0.02% of elements; with the kernel's former
    numerics ~42% differed)."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_bf16_reduced_precision_reduction", False)
    q, s, x = _weight_and_input(gen, n, k, block, m)
    got = fp8_linear.fp8_weight_only_linear(x, q, s, block_size=block)
    prefill = F.linear(x, fp8_blockwise.dequantize(q, s, block_size=block, dtype=torch.bfloat16))
    torch.cuda.synchronize()
    _, mag = _bf16_weight_product(x, q, s, block)
    err = (got.float() - prefill.float()).abs()
    bound = prefill.float().abs() * 2.0**-7 + 2 * ORDER * mag  # one bf16 step: <= 2^-7 relative
    assert bool((err <= bound).all()), f"error reaches {float((err / bound).max()):.3g} of the bound"
    equal = float((got == prefill).float().mean())
    assert equal >= 0.98, f"only {equal:.4f} of the elements are bit-equal to the prefill path's"


def test_fp8_gemv_is_deterministic_and_takes_batched_inputs(gen):
    q, s = fp8_blockwise.quantize(torch.randn(2048, 4096, generator=gen).cuda())
    x = torch.randn(4, 8, 4096, generator=gen).to(torch.bfloat16).cuda()
    a = fp8_linear.fp8_weight_only_linear(x, q, s)
    b = fp8_linear.fp8_weight_only_linear(x, q, s)
    assert a.shape == (4, 8, 2048) and torch.equal(a, b)
    ok, _ = _bounded(a.reshape(32, -1), x.reshape(32, -1), q, s, (128, 128))
    assert ok


@pytest.mark.parametrize("m", [1, 64])
def test_fp8_gemv_chain_replayed_from_a_cuda_graph_matches_eager_launches_without_pdl(gen, m, monkeypatch):
    """Each launch reads the previous one's output (with the opt-in programmatic dependent launch it
    prefetches weights, then waits for that kernel). A graph of a dependent chain, replayed after its input
    changed in place, gives the bits of the same chain launched eagerly without PDL."""
    from skyq.rollout.kernels import triton_fp8_gemv as kern

    dims = [2048, 4096, 2048, 512, 2048, 6144, 2048, 2048]
    weights = [
        fp8_blockwise.quantize((torch.randn(n, k, generator=gen) * k**-0.5).cuda())
        for k, n in zip(dims, dims[1:], strict=False)
    ]

    def chain(x):
        for q, s in weights:
            x = fp8_linear.fp8_weight_only_linear(x, q, s)
        return x

    monkeypatch.setattr(kern, "PDL", True)
    x = torch.randn(m, dims[0], generator=gen).to(torch.bfloat16).cuda()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        chain(x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = chain(x)
    outs = []
    for _ in range(3):
        x.copy_(torch.randn(m, dims[0], generator=gen).to(torch.bfloat16).cuda())
        graph.replay()
        outs.append((x.clone(), y.clone()))
    torch.cuda.synchronize()
    monkeypatch.setattr(kern, "PDL", False)
    for x_i, y_i in outs:
        assert torch.equal(chain(x_i), y_i)


def test_deferred_checks_name_the_bad_tensor_with_one_sync(gen):
    good = torch.randn(256, 256, generator=gen).cuda()
    bad = good.clone()
    bad[3, 7] = float("nan")
    with pytest.raises(Exception, match="second: 1 NaN"), dispatch.deferred_finite_checks():
        dispatch.quantize_fp8_blockwise(good, name="first")
        dispatch.quantize_fp8_blockwise(bad, name="second")
        dispatch.check_finite_deferred(bad, "third")
    with dispatch.deferred_finite_checks():
        q, s = dispatch.quantize_fp8_blockwise(good, name="first")
    q_ref, s_ref = fp8_blockwise.quantize(good)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref)


@pytest.mark.parametrize(("n", "k", "block"), SHAPES)
@pytest.mark.parametrize(
    ("m", "config"),
    [
        (1, (1, 16, 512, 1)),
        (1, (1, 64, 128, 4)),
        (2, (2, 32, 256, 2)),
        (3, (4, 16, 256, 8)),
        (4, (4, 16, 128, 1)),
    ],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_cuda_core_kernel_is_the_bf16_weight_product(gen, n, k, block, m, config, dtype):
    """The CUDA-core variant (BM < 16: no MMA, products summed elementwise over the K loop), forced
    by its config: within the same bound as the MMA kernel, every element written."""
    from skyq.rollout.kernels import triton_fp8_gemv as kern

    q, s, x = _weight_and_input(gen, n, k, block, m)
    got = kern.linear(x.to(dtype), q, s, block_size=block, config=config)
    torch.cuda.synchronize()
    assert got.shape == (m, n) and got.dtype == dtype
    ok, worst = _bounded(got, x, q, s, block)
    assert ok, f"error reaches {worst:.3g} of the bound"


GLUON_SHAPES = [
    (4096, 2048, (128, 128)),
    (5120, 2048, (128, 128)),
    (2048, 6144, (128, 128)),
    (301, 276, (128, 128)),
    (1000, 1032, (96, 128)),
    (768, 2048, (128, 64)),
]


@pytest.mark.parametrize(("n", "k", "block"), GLUON_SHAPES)
@pytest.mark.parametrize(
    ("m", "config"),
    [
        (1, (8, 64, 128, 1, 4, 1)),
        (3, (8, 64, 128, 4, 4, 1)),
        (16, (16, 128, 128, 2, 8, 1)),
        (17, (32, 64, 128, 8, 4, 1)),
        (64, (64, 64, 64, 1, 4, 1)),
        (64, (64, 128, 64, 2, 4, 1)),
        (1, (8, 16, 128, 1, 1, 8)),
        (5, (8, 32, 128, 1, 2, 4)),
        (12, (16, 64, 128, 2, 4, 2)),
        (33, (64, 32, 64, 1, 2, 4)),
        (16, (8, 16, 128, 1, 1, 8)),
        (13, (8, 16, 128, 2, 1, 2)),
    ],
)
@pytest.mark.parametrize("prefetch", [0, 1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_gluon_kernel_is_the_bf16_weight_product(gen, n, k, block, m, config, prefetch, dtype):
    """The Gluon kernel (codes read as int32 words into the MMA operand registers, K permuted in
    64-column chunks on both operands) at explicit tilings: K and N tails, rows past the batch, the
    batch in several row tiles, per-row scales (96-row blocks), 64-column scale blocks, split-K, K
    warps (groups of warps on parts of a split's K range, summed in the program; groups past K), no
    prefetch, one step or two (ping-pong, zero-scale steps past a group's end) loaded ahead, or one
    step of codes only; fp32 (and bf16 as int32 pairs) activations: within the MMA kernel's bound,
    every element written."""
    from skyq.rollout.kernels import gluon_fp8_gemv as g
    from skyq.rollout.kernels import triton_fp8_gemv as kern

    bm, bn, kc, split, warps, kwarps = config
    if block[1] % kc:
        kc = block[1]
    q, s, x = _weight_and_input(gen, n, k, block, m)
    got = g.linear(
        x.to(dtype), q, s, block_size=block, sms=kern.sm_count(x.device), counters=kern._arrival_counters,
        config=(bm, bn, kc, split, warps, kwarps), prefetch=prefetch,
    )  # fmt: skip
    torch.cuda.synchronize()
    assert got.shape == (m, n) and got.dtype == dtype
    ok, worst = _bounded(got, x, q, s, block)
    assert ok, f"error reaches {worst:.3g} of the bound"


@pytest.mark.parametrize(
    ("n", "k", "block"),
    [(1536, 2048, (128, 128)), (2048, 768, (128, 128)), (301, 1000, (128, 128)), (200, 512, (64, 128))],
)
@pytest.mark.parametrize(
    "rows",
    [
        [1, 0, 3, 0, 0, 2, 1, 1],
        [0, 17, 5, 40, 0, 2, 0, 0],
        [64],
        [0, 0, 9, 0],
        [130, 33, 0, 97],
        [40, 70, 31, 64, 50],
    ],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_grouped_kernel_is_each_experts_bf16_weight_product(gen, n, k, block, rows, dtype):
    """`gluon_fp8_gemv.linear_grouped` (one launch over the experts, rows sorted by expert): each
    expert's rows within the MMA kernel's bound of its own bf16-weight product; experts without
    rows, experts with more rows than a tile (the tile loop), N and K tails, per-row scales."""
    from skyq.rollout.kernels import gluon_fp8_gemv as g
    from skyq.rollout.kernels import triton_fp8_gemv as kern

    w = torch.randn(len(rows), n, k, generator=gen) * torch.logspace(-3, 1, n).unsqueeze(1)
    q, s = fp8_blockwise.quantize(w.cuda(), block_size=block)
    t = sum(rows)
    x = torch.randn(t, k, generator=gen).to(torch.bfloat16).cuda()
    offsets = torch.tensor([0, *torch.tensor(rows).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    got = g.linear_grouped(x.to(dtype), q, s, offsets, block_size=block, sms=kern.sm_count(x.device))
    assert got.shape == (t, n) and got.dtype == dtype
    bounds = offsets.tolist()
    for e, (a, b) in enumerate(zip(bounds, bounds[1:])):
        if b > a:
            ok, worst = _bounded(got[a:b], x[a:b], q[e], s[e], block)
            assert ok, f"expert {e}: error reaches {worst:.3g} of the bound"
    if dtype == torch.bfloat16:  # the public call takes the kernel and gives the same bits
        assert torch.equal(fp8_linear.fp8_grouped_weight_only_linear(x, q, s, offsets, block), got)


def test_decode_dispatches_to_the_gluon_kernel_where_it_applies(gen):
    from skyq.rollout.kernels import triton_fp8_gemv as kern

    q, s, x = _weight_and_input(gen, 512, 2048, (128, 128), 4)
    assert kern._gluon_applies(x, q, (128, 128))
    assert not kern._gluon_applies(x, q[:, :2046], (128, 128))  # rows not 4-byte aligned
    assert not kern._gluon_applies(x, q, (128, 32))
    # more than GLUON_MAX_M rows only for weights too small to fill the GPU with the Triton kernel's tiles
    small, _, _ = _weight_and_input(gen, 1536, 1024, (128, 128), 1)
    big, _, _ = _weight_and_input(gen, 5120, 2048, (128, 128), 1)
    assert kern._gluon_applies(torch.zeros(kern.GLUON_MAX_M, 2048, device=x.device), big, (128, 128))
    for rows in (kern.GLUON_MAX_M + 1, 24, 33, 64):
        assert kern._gluon_applies(torch.zeros(rows, 1024, device=x.device), small, (128, 128))
        assert not kern._gluon_applies(torch.zeros(rows, 2048, device=x.device), big, (128, 128))
    assert not kern._gluon_applies(
        torch.zeros(kern.DECODE_ROWS + 1, 1024, device=x.device), small, (128, 128)
    )
    a = fp8_linear.fp8_weight_only_linear(x, q, s)
    kern.GLUON = False
    try:
        b = fp8_linear.fp8_weight_only_linear(x, q, s)
    finally:
        kern.GLUON = True
    for got in (a, b):
        assert _bounded(got, x, q, s, (128, 128))[0]
