"""The Triton kernels give the same bits as the skyq.quant references, on the GPU, on fresh
random data of many shapes (odd ones included), dtypes and memory layouts."""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from skyq.quant import fp8_blockwise, int4, mxfp8
from skyq.quant.errors import QuantizationError
from skyq.quant.kernels import dispatch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or importlib.util.find_spec("triton") is None,
        reason="needs CUDA and Triton",
    ),
]

SHAPES = [(1, 1), (7, 300), (129, 257), (256, 128), (300, 1000), (1000, 4096), (2, 130, 250), (4, 256, 768)]
LAYOUTS = ["contiguous", "transposed", "strided"]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def assert_same_bits(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[actual.element_size()]
    diff = actual.contiguous().view(as_int) != expected.contiguous().view(as_int)
    assert not bool(diff.any()), (
        f"{int(diff.sum())} of {diff.numel()} elements differ; first at {diff.nonzero()[0].tolist()}"
    )


def test_dispatch_picks_the_kernel_for_cuda_tensors():
    assert dispatch.uses_kernel(torch.zeros(1, device="cuda"))
    assert not dispatch.uses_kernel(torch.zeros(1))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [(128, 128), (1, 128), (64, 32)])
def test_fp8_blockwise_quantize_matches_reference(make_weight, shape, dtype, block_size):
    for layout in LAYOUTS:
        w = make_weight(shape, dtype, layout)
        for pow2 in (False, True):
            q, s = dispatch.quantize_fp8_blockwise(w, block_size=block_size, pow2_scale=pow2)
            q_ref, s_ref = fp8_blockwise.quantize(w, block_size=block_size, pow2_scale=pow2)
            assert_same_bits(q, q_ref)
            assert_same_bits(s, s_ref)


def test_fp8_blockwise_kernel_equals_the_cpu_reference_too(make_weight):
    w = make_weight((384, 640), torch.bfloat16)
    q, s = dispatch.quantize_fp8_blockwise(w)
    q_ref, s_ref = fp8_blockwise.quantize(w.cpu())
    assert_same_bits(q.cpu(), q_ref)
    assert_same_bits(s.cpu(), s_ref)


@pytest.mark.parametrize("exponent", [-38, -30, -12, 0, 12, 30, 37])
def test_fp8_blockwise_extreme_magnitudes(gen, exponent):
    """Tiny and huge blocks reach the FLT_MAX scale clamp and subnormal scale_inv: no flush-to-zero."""
    w = (torch.randn(256, 256, generator=gen) * 10.0**exponent).cuda()
    w[:128, :128] = 0.0
    for pow2 in (False, True):
        q, s = dispatch.quantize_fp8_blockwise(w, pow2_scale=pow2)
        q_ref, s_ref = fp8_blockwise.quantize(w, pow2_scale=pow2)
        assert_same_bits(q, q_ref)
        assert_same_bits(s, s_ref)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [(128, 128), (1, 128), (1, 64), (64, 32), (256, 64)])
def test_fp8_blockwise_fake_quant_in_one_pass_matches_reference(make_weight, shape, dtype, block_size):
    """The one-pass fake quantization (trainer QAT weights, the activations of both sides) gives the
    reference quantize-then-dequantize bits in the input's dtype, every layout, both scale formats."""
    for layout in LAYOUTS:
        w = make_weight(shape, dtype, layout)
        for pow2 in (False, True):
            y = dispatch.fake_quant_fp8_blockwise(w, block_size=block_size, pow2_scale=pow2)
            q_ref, s_ref = fp8_blockwise.quantize(w, block_size=block_size, pow2_scale=pow2)
            assert_same_bits(y, fp8_blockwise._dequantize(q_ref, s_ref, *block_size, dtype))


@pytest.mark.parametrize("exponent", [-38, -30, -12, 0, 12, 30, 37])
def test_fp8_blockwise_fake_quant_extreme_magnitudes(gen, exponent):
    w = (torch.randn(256, 256, generator=gen) * 10.0**exponent).cuda()
    w[:128, :128] = 0.0
    for block_size in ((128, 128), (1, 128)):
        q_ref, s_ref = fp8_blockwise.quantize(w, block_size=block_size)
        y = dispatch.fake_quant_fp8_blockwise(w, block_size=block_size)
        assert_same_bits(y, fp8_blockwise._dequantize(q_ref, s_ref, *block_size, w.dtype))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("block_size", [(128, 128), (1, 128), (96, 80)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp8_blockwise_dequantize_matches_reference(make_weight, shape, block_size, dtype):
    q, s = fp8_blockwise.quantize(make_weight(shape, torch.float32), block_size=block_size)
    assert_same_bits(
        dispatch.dequantize_fp8_blockwise(q, s, block_size=block_size, dtype=dtype),
        fp8_blockwise.dequantize(q, s, block_size=block_size, dtype=dtype),
    )


@pytest.mark.parametrize("shape", [(1, 32), (7, 320), (129, 256), (300, 1024), (1000, 4096), (3, 130, 96)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_mxfp8_quantize_and_dequantize_match_reference(make_weight, shape, dtype):
    for layout in LAYOUTS:
        w = make_weight(shape, dtype, layout)
        q, s = dispatch.quantize_mxfp8(w)
        q_ref, s_ref = mxfp8.quantize(w)
        assert_same_bits(q, q_ref)
        assert_same_bits(s, s_ref)
        for out_dtype in (torch.bfloat16, torch.float32):
            assert_same_bits(
                dispatch.dequantize_mxfp8(q_ref, s_ref, dtype=out_dtype),
                mxfp8.dequantize(q_ref, s_ref, dtype=out_dtype),
            )
        if shape[-1] % 32 == 0:  # the one-pass fake quant (the trainer's and the engine's inputs)
            assert_same_bits(dispatch.fake_quant_mxfp8(w), mxfp8._dequantize(q_ref, s_ref, w.dtype))


@pytest.mark.parametrize("exponent", [-44, -38, -20, 0, 20, 37])
def test_mxfp8_extreme_magnitudes_and_padding(gen, exponent):
    w = (torch.randn(64, 100, generator=gen, dtype=torch.float64) * 10.0**exponent).float().cuda()
    w[:3] = 0.0
    q, s = dispatch.quantize_mxfp8(w, allow_pad=True)
    q_ref, s_ref = mxfp8.quantize(w, allow_pad=True)
    assert_same_bits(q, q_ref)
    assert_same_bits(s, s_ref)
    assert_same_bits(dispatch.dequantize_mxfp8(q_ref, s_ref), mxfp8.dequantize(q_ref, s_ref))
    w96 = w[:, :96].contiguous()
    assert_same_bits(dispatch.fake_quant_mxfp8(w96), mxfp8._dequantize(*mxfp8.quantize(w96), w96.dtype))


@pytest.mark.parametrize(
    "shape",
    [(1, 128), (7, 256), (129, 512), (300, 2048), (1000, 4096), (3, 130, 256), (33, 384), (5, 17, 640)],
)
@pytest.mark.parametrize("group_size", [32, 128])
@pytest.mark.parametrize("grid", ["kimi", "rtn"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_int4_quantize_pack_and_dequantize_match_reference(make_weight, shape, group_size, grid, dtype):
    for layout in LAYOUTS:
        w = make_weight(shape, dtype, layout)
        codes, scale = dispatch.quantize_int4(w, group_size=group_size, grid=grid)
        codes_ref, scale_ref = int4.quantize(w, group_size=group_size, grid=grid)
        assert_same_bits(codes, codes_ref)
        assert_same_bits(scale, scale_ref)
        packed, scale_p = dispatch.quantize_int4_packed(w, group_size=group_size, grid=grid)
        assert_same_bits(packed, int4.pack(codes_ref))
        assert_same_bits(scale_p, scale_ref)
        n, k = shape[-2:]
        for out_dtype in (torch.bfloat16, torch.float32):
            assert_same_bits(
                dispatch.dequantize_int4_packed(packed, scale_p, [n, k], dtype=out_dtype),
                int4.dequantize_packed(packed, scale_p, [n, k], dtype=out_dtype),
            )


@pytest.mark.parametrize(
    "call",
    [
        lambda w: dispatch.quantize_fp8_blockwise(w, name="layer.w"),
        lambda w: dispatch.quantize_fp8_activation(w, name="layer.w"),
        lambda w: dispatch.fake_quant_fp8_blockwise(w, block_size=(1, 128), name="layer.w"),
        lambda w: dispatch.quantize_mxfp8(w, name="layer.w"),
        lambda w: dispatch.quantize_int4_packed(w, group_size=32, name="layer.w"),
    ],
)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_input_is_refused_with_the_reference_message(gen, call, bad):
    w = torch.randn(256, 512, generator=gen).cuda()
    w[int(torch.randint(256, (1,), generator=gen)), int(torch.randint(512, (1,), generator=gen))] = bad
    with pytest.raises(QuantizationError, match=r"layer\.w: .*refusing to quantize a non-finite tensor"):
        call(w)


def test_nan_codes_and_nan_scale_bytes_are_refused():
    q = torch.zeros(128, 128, dtype=torch.uint8, device="cuda")
    q[5, 7] = 0x7F
    with pytest.raises(QuantizationError, match="NaN code"):
        dispatch.dequantize_fp8_blockwise(q.view(torch.float8_e4m3fn), torch.ones(1, 1, device="cuda"))
    s = torch.full((128, 4), 127, dtype=torch.uint8, device="cuda")
    s[3, 1] = 0xFF
    with pytest.raises(QuantizationError, match="E8M0 NaN"):
        dispatch.dequantize_mxfp8(torch.zeros(128, 128, device="cuda").to(torch.float8_e4m3fn), s)


# --- the GEMM operand quantizers of the FP8 linear ---------------------------------------------


@pytest.mark.parametrize("m,k", [(1, 128), (77, 768), (128, 2048), (1000, 1536), (4096, 4096), (300, 576)])
@pytest.mark.parametrize("layout", ["contiguous", "strided"])
@pytest.mark.parametrize("variant", [(4, 16), (8, 16), (8, 32), (16, 32), (4, 128), (8, 128), (16, 128)])
def test_activation_operands_match_reference(make_weight, m, k, layout, variant):
    from skyq.quant.kernels import triton_fp8_act

    x = make_weight((m, k), torch.bfloat16, layout)
    mp = -(-m // 128) * 128
    xp = F.pad(x, (0, 0, 0, mp - m))  # padding rows: codes 0, scale 1, as the reference gives
    q_ref, s_ref = fp8_blockwise.quantize_activation(xp)
    q, s = triton_fp8_act.quantize_rows(x)
    assert s.stride() == (1, mp)
    assert_same_bits(q, q_ref)
    assert_same_bits(s.contiguous(), s_ref)
    num_warps, sub = variant
    q2, s2, qt, st = triton_fp8_act.quantize_rows_cols(x, sub=sub, num_warps=num_warps)
    assert_same_bits(q2, q_ref)
    assert_same_bits(s2.contiguous(), s_ref)
    qt_ref, st_ref = fp8_blockwise.quantize_activation(xp.t())
    assert st.stride() == (1, k)
    assert_same_bits(qt, qt_ref)
    assert_same_bits(st.contiguous(), st_ref)


@pytest.mark.parametrize("shape", [(768, 2048), (2048, 768), (576, 7168), (1000, 1280), (3, 1536, 2048)])
def test_weight_operands_match_reference_with_padded_scales(make_weight, shape):
    from skyq.quant.kernels import triton_fp8_act

    w = make_weight(shape, torch.bfloat16)
    q, s_fwd, qt, s_bwd = triton_fp8_act.quantize_weight(w)
    q_ref, s_ref = fp8_blockwise.quantize(w)
    nn_, nk = s_ref.shape[-2:]
    assert_same_bits(q, q_ref)
    assert_same_bits(qt, q_ref.transpose(-1, -2).contiguous())
    assert s_fwd.shape[-2:] == (-(-nk // 4) * 4, nn_) and s_fwd.stride()[-2:] == (1, s_fwd.shape[-2])
    assert s_bwd.shape[-2:] == (-(-nn_ // 4) * 4, nk) and s_bwd.stride()[-2:] == (1, s_bwd.shape[-2])
    assert_same_bits(s_fwd[..., :nk, :].transpose(-1, -2).contiguous(), s_ref)
    assert_same_bits(s_bwd[..., :nn_, :].contiguous(), s_ref)
    assert bool((s_fwd[..., nk:, :] == 1).all()) and bool((s_bwd[..., nn_:, :] == 1).all())


@pytest.mark.parametrize("grid", ["kimi", "rtn"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_int4_codes_on_and_next_to_rounding_ties_match_reference(gen, grid, dtype):
    """The kernel's division-free quotient must round exactly like the reference's IEEE division
    where it matters: x / s on a half-integer, and (fp32) one or two ulps beside one."""
    divisor = {"kimi": 7.0, "rtn": 7.5}[grid]
    n, k, g = 64, 512, 32
    scale = (torch.rand(n, k // g, 1, generator=gen) + 0.5).to(torch.bfloat16).float()
    w = (torch.randint(-8, 8, (n, k // g, g), generator=gen).float() + 0.5) * scale
    w = w * (1 + torch.randint(-2, 3, w.shape, generator=gen).float() * 2.0**-24)
    w[..., 0] = scale[..., 0] * divisor  # the group max, so the scale is `scale`
    w = w.reshape(n, k).to(dtype).cuda()
    codes, scale_k = dispatch.quantize_int4(w, group_size=g, grid=grid)
    codes_ref, scale_ref = int4.quantize(w, group_size=g, grid=grid)
    assert_same_bits(codes, codes_ref)
    assert_same_bits(scale_k, scale_ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("pow2", [False, True])
def test_grouped_fp8_quantize_gives_each_tensors_reference_bits(make_weight, dtype, pow2):
    """One launch for many tensors of many shapes and layouts (`quantize_fp8_blockwise_group`),
    the same bits as the reference of each; a non-finite input is refused naming its tensor."""
    ws = [make_weight(shape, dtype, layout) for shape, layout in zip(SHAPES, LAYOUTS * 3)]
    names = [f"w{i}.weight" for i in range(len(ws))]
    got = dispatch.quantize_fp8_blockwise_group(ws, names, pow2_scale=pow2)
    for w, (q, s) in zip(ws, got):
        rq, rs = fp8_blockwise.quantize(w.cpu(), block_size=(128, 128), pow2_scale=pow2)
        assert_same_bits(q.cpu(), rq)
        assert_same_bits(s.cpu(), rs)
    bad = [w.clone() for w in ws]
    bad[3].view(-1)[7] = float("nan")
    with pytest.raises(QuantizationError, match="w3.weight: 1 NaN"):
        dispatch.quantize_fp8_blockwise_group(bad, names, pow2_scale=pow2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_grouped_mxfp8_quantize_gives_each_tensors_reference_bits(make_weight, dtype):
    shapes = [(1, 32), (7, 320), (129, 256), (300, 1024), (2, 130, 96), (4, 256, 768)]
    ws = [make_weight(shape, dtype, layout) for shape, layout in zip(shapes, LAYOUTS * 2)]
    names = [f"m{i}.weight" for i in range(len(ws))]
    for group in (ws, [w.contiguous() for w in ws]):  # strided members, then the vectorized path
        for w, (q, s) in zip(group, dispatch.quantize_mxfp8_group(group, names)):
            rq, rs = mxfp8.quantize(w.cpu())
            assert_same_bits(q.cpu(), rq)
            assert_same_bits(s.cpu(), rs)
    bad = [w.contiguous() for w in ws]
    bad[2].view(-1)[5] = float("inf")
    with pytest.raises(QuantizationError, match="m2.weight: 0 NaN and 1 inf"):
        dispatch.quantize_mxfp8_group(bad, names)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("grid", ["kimi", "rtn"])
def test_grouped_int4_quantize_gives_each_tensors_reference_bits(make_weight, dtype, grid):
    """`quantize_int4_packed_group`: one launch, the packed words and scales of `int4.pack(int4.quantize)`
    of each tensor; a non-finite input is refused naming its tensor."""
    shapes = [(1, 32), (7, 320), (129, 256), (300, 1024), (2, 130, 96), (4, 256, 768)]
    ws = [make_weight(shape, dtype, layout) for shape, layout in zip(shapes, LAYOUTS * 2)]
    names = [f"i{i}.weight" for i in range(len(ws))]
    for group in (ws, [w.contiguous() for w in ws]):  # strided members, then the vectorized path
        for w, (p, s) in zip(
            group, dispatch.quantize_int4_packed_group(group, names, group_size=32, grid=grid)
        ):
            rq, rs = int4.quantize(w.cpu(), group_size=32, grid=grid)
            assert_same_bits(p.cpu(), int4.pack(rq))
            assert_same_bits(s.cpu(), rs)
    bad = [w.contiguous() for w in ws]
    bad[4].view(-1)[9] = float("nan")
    with pytest.raises(QuantizationError, match="i4.weight: 1 NaN"):
        dispatch.quantize_int4_packed_group(bad, names, group_size=32, grid=grid)
