"""fp8_blockwise against an independent numpy + ml_dtypes reference (a loop over blocks)."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from skyq.quant import fp8_blockwise
from skyq.quant.errors import QuantizationError

F32 = np.float32
E4M3 = ml_dtypes.float8_e4m3fn
FLT_MAX = np.finfo(np.float32).max
LAYOUTS = ("contiguous", "transposed", "strided")


# ---------------------------------------------------------------- independent reference
def ref_scale(amax: np.float32, pow2: bool) -> np.float32:
    if amax == 0:
        return F32(1.0)
    with np.errstate(over="ignore"):
        scale = F32(448.0) / F32(amax)  # numpy float32 division is correctly rounded
    if np.isinf(scale):
        scale = FLT_MAX
    if pow2:
        mantissa, exponent = math.frexp(float(scale))
        scale = F32(math.ldexp(0.5, exponent))
    return scale


def ref_quantize(w: np.ndarray, bn: int, bk: int, pow2: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Per-block loop. Returns (q as uint8 bits, scale_inv float32)."""
    *lead, n, k = w.shape
    mats = w.reshape(-1, n, k).astype(F32)
    nbn, nbk = -(-n // bn), -(-k // bk)
    q = np.zeros(mats.shape, dtype=E4M3)
    inv = np.zeros((mats.shape[0], nbn, nbk), dtype=F32)
    for e in range(mats.shape[0]):
        for i in range(nbn):
            for j in range(nbk):
                block = mats[e, i * bn : (i + 1) * bn, j * bk : (j + 1) * bk]
                scale = ref_scale(np.abs(block).max(), pow2)
                q[e, i * bn : (i + 1) * bn, j * bk : (j + 1) * bk] = np.clip(block * scale, -448, 448).astype(
                    E4M3
                )
                inv[e, i, j] = F32(1.0) / scale
    return q.view(np.uint8).reshape(w.shape), inv.reshape(*lead, nbn, nbk)


def ref_dequantize(q_bits: np.ndarray, inv: np.ndarray, bn: int, bk: int) -> np.ndarray:
    n, k = q_bits.shape[-2:]
    s = np.repeat(np.repeat(inv, bn, axis=-2), bk, axis=-1)[..., :n, :k]
    return q_bits.view(E4M3).astype(F32) * s


def bits(q: torch.Tensor) -> np.ndarray:
    return q.view(torch.uint8).numpy()


def assert_matches_reference(w: torch.Tensor, block_size=(128, 128), pow2: bool = False) -> None:
    q, inv = fp8_blockwise.quantize(w, block_size=block_size, pow2_scale=pow2)
    ref_q, ref_inv = ref_quantize(w.float().numpy(), *block_size, pow2)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert inv.dtype == torch.float32
    np.testing.assert_array_equal(bits(q), ref_q)
    np.testing.assert_array_equal(inv.numpy().view(np.uint32), ref_inv.view(np.uint32))
    deq = fp8_blockwise.dequantize(q, inv, block_size=block_size, dtype=torch.float32)
    np.testing.assert_array_equal(
        deq.numpy().view(np.uint32), ref_dequantize(ref_q, ref_inv, *block_size).view(np.uint32)
    )


SHAPES = [(128, 128), (256, 384), (300, 200), (1, 500), (500, 1), (129, 127), (3, 130, 257), (2, 1, 1)]


# ---------------------------------------------------------------- bit-exact agreement
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("pow2", [False, True])
def test_quantize_matches_reference_across_shapes_and_dtypes(make_weight, shape, dtype, pow2):
    assert_matches_reference(make_weight(shape, dtype), pow2=pow2)


@pytest.mark.parametrize("shape", [(303, 300), (305, 256), (11, 11), (587, 7168), (4, 192, 576)])
def test_quantize_matches_reference_on_odd_and_checkpoint_shapes(make_weight, shape):
    w = make_weight(shape, torch.bfloat16)
    before = w.clone()
    assert_matches_reference(w)
    assert torch.equal(w, before)  # the input (maybe a tied or shared tensor) is never modified


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("shape", [(200, 300), (2, 129, 260)])
def test_quantize_matches_reference_for_non_contiguous_views(make_weight, layout, shape):
    assert_matches_reference(make_weight(shape, torch.bfloat16, layout))


@pytest.mark.parametrize("block_size", [(1, 128), (32, 64), (7, 5), (128, 1)])
def test_quantize_matches_reference_for_other_block_sizes(make_weight, block_size):
    assert_matches_reference(make_weight((70, 300), torch.bfloat16), block_size=block_size, pow2=False)


def test_dequantize_to_bf16_is_the_fp32_product_rounded_once(make_weight):
    w = make_weight((200, 300), torch.bfloat16)
    q, inv = fp8_blockwise.quantize(w)
    ref = ref_dequantize(bits(q), inv.numpy(), 128, 128).astype(ml_dtypes.bfloat16)
    got = fp8_blockwise.dequantize(q, inv)
    assert got.dtype == torch.bfloat16
    np.testing.assert_array_equal(got.view(torch.uint16).numpy(), ref.view(np.uint16))


@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("shape", [(4, 300), (2, 3, 128), (1, 1), (5, 129)])
def test_activation_tiles_match_reference(make_weight, shape, pow2):
    x = make_weight(shape, torch.bfloat16)
    q, inv = fp8_blockwise.quantize_activation(x, pow2_scale=pow2)
    ref_q, ref_inv = ref_quantize(x.float().numpy(), 1, 128, pow2)
    assert inv.shape == (*shape[:-1], math.ceil(shape[-1] / 128))
    np.testing.assert_array_equal(bits(q), ref_q)
    np.testing.assert_array_equal(inv.numpy(), ref_inv)
    deq = fp8_blockwise.dequantize_activation(q, inv, dtype=torch.float32)
    np.testing.assert_array_equal(deq.numpy(), ref_dequantize(ref_q, ref_inv, 1, 128))


@pytest.mark.parametrize("shape", [(130, 70), (1, 9), (9, 1), (2, 5, 33)])
def test_per_channel_matches_reference(make_weight, shape):
    w = make_weight(shape, torch.bfloat16, "transposed")
    q, ws = fp8_blockwise.quantize_per_channel(w)
    ref_q, ref_inv = ref_quantize(w.float().numpy(), 1, shape[-1])
    assert ws.shape == (*shape[:-1], 1)
    np.testing.assert_array_equal(bits(q), ref_q)
    np.testing.assert_array_equal(ws.numpy(), ref_inv)
    deq = fp8_blockwise.dequantize_per_channel(q, ws, torch.float32)
    np.testing.assert_array_equal(deq.numpy(), ref_dequantize(ref_q, ref_inv, 1, shape[-1]))


@pytest.mark.parametrize("shape", [(130, 70), (1, 1), (3, 4, 5)])
def test_per_tensor_matches_reference_with_a_one_element_scale(make_weight, shape):
    w = make_weight(shape, torch.float16)
    q, ws = fp8_blockwise.quantize_per_tensor(w)
    assert ws.shape == (1,)
    flat = w.float().numpy().reshape(1, -1)
    ref_q, ref_inv = ref_quantize(flat, 1, flat.shape[1])
    np.testing.assert_array_equal(bits(q).reshape(1, -1), ref_q)
    assert ws.item() == ref_inv.item()
    deq = fp8_blockwise.dequantize_per_tensor(q, ws, torch.float32)
    np.testing.assert_array_equal(deq.numpy(), q.float().numpy() * ref_inv.item())


# ---------------------------------------------------------------- the 448 / t trap
def test_scale_is_a_correctly_rounded_division(gen):
    exponents = torch.rand(200_000, generator=gen, dtype=torch.float64) * 260 - 140  # subnormals to 2^120
    amax = (torch.rand(200_000, generator=gen, dtype=torch.float64) + 1) * 2.0**exponents
    amax = amax.float()
    amax[:3] = torch.tensor([0.0, 1e-45, 448.0])
    got = fp8_blockwise.scale_from_amax(amax).numpy()
    a = amax.numpy()
    with np.errstate(over="ignore", divide="ignore"):
        want = F32(448.0) / a
    want[np.isinf(want)] = FLT_MAX
    want[a == 0] = 1.0
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    assert got[1] == FLT_MAX and got[0] == 1.0 and got[2] == 1.0


def test_scale_inv_is_a_correctly_rounded_reciprocal(make_weight):
    w = make_weight((1024, 1024))
    _, inv = fp8_blockwise.quantize(w, block_size=(16, 16))
    amax = w.reshape(64, 16, 64, 16).abs().amax(dim=(1, 3)).numpy()
    np.testing.assert_array_equal(inv.numpy(), F32(1.0) / (F32(448.0) / amax))


# ---------------------------------------------------------------- extremes
def test_all_zero_blocks_get_scale_one_and_zero_codes(gen):
    w = torch.zeros(300, 200, dtype=torch.bfloat16)
    w[:128, :128] = torch.randn(128, 128, generator=gen).to(torch.bfloat16)
    q, inv = fp8_blockwise.quantize(w)
    assert inv[1:, :].eq(1.0).all() and inv[:, 1:].eq(1.0).all()
    assert q.float()[128:].eq(0).all()
    assert torch.isfinite(fp8_blockwise.dequantize(q, inv)).all()
    assert_matches_reference(w)


def test_single_nonzero_element_maps_to_448(gen):
    w = torch.zeros(128, 128)
    w[17, 33] = -3.7
    q, inv = fp8_blockwise.quantize(w)
    assert q.float()[17, 33] == -448.0 and q.float().count_nonzero() == 1
    assert_matches_reference(w)


@pytest.mark.parametrize("magnitude", [1e-40, 1e-45, 1e-38, 2.0**-126])
def test_subnormal_blocks_saturate_the_scale_at_flt_max_without_nan(magnitude, gen):
    w = (torch.randn(64, 64, generator=gen) * magnitude).float()
    w[0, 0] = magnitude
    q, inv = fp8_blockwise.quantize(w, block_size=(32, 32))
    assert not q.float().isnan().any() and torch.isfinite(inv).all() and (inv > 0).all()
    assert_matches_reference(w, block_size=(32, 32))
    assert_matches_reference(w, block_size=(32, 32), pow2=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_large_values_saturate_and_never_give_nan(dtype, gen):
    w = torch.linspace(447, 480, 128 * 128).reshape(128, 128)
    w[::3] *= -1
    w[5, 5] = 1e4
    for x in (
        w,
        w.clone().fill_(1e4),
        torch.full((4, 4), 3e38),
        torch.full((4, 4), torch.finfo(dtype).max),
    ):
        x = x.to(dtype)
        q, inv = fp8_blockwise.quantize(x)
        assert not torch.isnan(q.float()).any()
        assert q.float().abs().max() == 448.0
        assert_matches_reference(x)


# ---------------------------------------------------------------- refusals
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_non_finite_input_is_refused_naming_the_tensor(bad, dtype):
    w = torch.ones(4, 4, dtype=dtype)
    w[1, 2] = bad
    for fn in (
        lambda: fp8_blockwise.quantize(w, name="layers.3.mlp.experts.7.w1"),
        lambda: fp8_blockwise.quantize_per_channel(w, name="layers.3.mlp.experts.7.w1"),
        lambda: fp8_blockwise.quantize_per_tensor(w, name="layers.3.mlp.experts.7.w1"),
        lambda: fp8_blockwise.quantize_activation(w, name="layers.3.mlp.experts.7.w1"),
    ):
        with pytest.raises(QuantizationError, match=r"layers\.3\.mlp\.experts\.7\.w1: .*1 (NaN|inf)"):
            fn()


def test_impossible_shapes_and_types_are_refused_with_the_arithmetic():
    with pytest.raises(QuantizationError, match="at least 2 dims"):
        fp8_blockwise.quantize(torch.ones(8))
    with pytest.raises(QuantizationError, match="block_size"):
        fp8_blockwise.quantize(torch.ones(8, 8), block_size=(0, 128))
    with pytest.raises(QuantizationError, match="floating-point"):
        fp8_blockwise.quantize(torch.ones(8, 8, dtype=torch.int32))
    with pytest.raises(QuantizationError, match="no elements"):
        fp8_blockwise.quantize(torch.ones(0, 8))
    q, inv = fp8_blockwise.quantize(torch.ones(300, 200))
    with pytest.raises(
        QuantizationError, match=r"expected shape \(3, 2\) \(ceil\(300/128\), ceil\(200/128\)"
    ):
        fp8_blockwise.dequantize(q, inv[:2])
    with pytest.raises(QuantizationError, match="dtype"):
        fp8_blockwise.dequantize(q.float(), inv)


def test_dequantize_refuses_nan_codes_and_non_finite_scales():
    q, inv = fp8_blockwise.quantize(torch.ones(4, 4))
    with pytest.raises(QuantizationError, match="weight_scale_inv"):
        fp8_blockwise.dequantize(q, inv * float("nan"))
    bad = q.clone()
    bad.view(torch.uint8)[0, 0] = 0x7F
    with pytest.raises(QuantizationError, match="1 NaN code"):
        fp8_blockwise.dequantize(bad, inv)


# ---------------------------------------------------------------- pow2 scales
def test_is_pow2_accepts_exactly_e8m0_representable_powers_of_two():
    assert fp8_blockwise.is_pow2(torch.tensor([2.0**-127, 2.0**-126, 1.0, 0.25, 2.0**127]))
    for bad in (3.0, 0.0, -1.0, 2.0**-128, float("inf"), float("nan")):
        assert not fp8_blockwise.is_pow2(torch.tensor([1.0, bad]))


def test_pow2_scales_are_powers_of_two_and_rounded_down(make_weight):
    w = make_weight((3, 300, 260))
    _, inv = fp8_blockwise.quantize(w, pow2_scale=True)
    _, inv_fp32 = fp8_blockwise.quantize(w)
    assert fp8_blockwise.is_pow2(inv)
    assert not fp8_blockwise.is_pow2(inv_fp32)
    assert (inv >= inv_fp32).all()  # scale rounded down <=> scale_inv rounded up
    assert (inv < 2 * inv_fp32).all()


# ---------------------------------------------------------------- properties
weight_specs = st.tuples(
    st.integers(0, 2**32 - 1),
    st.builds(
        lambda lead, n, k: (*lead, n, k),
        st.sampled_from([(), (2,)]),
        st.integers(1, 200),
        st.integers(1, 200),
    ),
    st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
    st.sampled_from(LAYOUTS),
)
blocks = st.sampled_from([(128, 128), (32, 32), (1, 128), (16, 64)])


@given(spec=weight_specs, block_size=blocks, pow2=st.booleans())
def test_round_trip_error_is_within_half_an_e4m3_step(weight_from_seed, spec, block_size, pow2):
    w = weight_from_seed(*spec)
    q, inv = fp8_blockwise.quantize(w, block_size=block_size, pow2_scale=pow2)
    deq = fp8_blockwise.dequantize(q, inv, block_size=block_size, dtype=torch.float32)
    bn, bk = block_size
    n, k = w.shape[-2:]
    s_inv = inv.repeat_interleave(bn, -2)[..., :n, :].repeat_interleave(bk, -1)[..., :k].double()
    x = w.double()
    # In scaled units an e4m3 value is off by at most half a step: 2^-4 relative, 2^-10 absolute
    # (subnormals); the fp32 scale and its reciprocal add a few ulps.
    bound = torch.maximum(x.abs() / s_inv * 2.0**-4, torch.full_like(x, 2.0**-10)) * s_inv * (1 + 1e-6)
    assert ((deq.double() - x).abs() <= bound).all()


@given(spec=weight_specs, block_size=blocks, dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_requantizing_a_dequantized_weight_gives_the_same_codes(weight_from_seed, spec, block_size, dtype):
    w = weight_from_seed(*spec)
    q, inv = fp8_blockwise.quantize(w, block_size=block_size)
    deq = fp8_blockwise.dequantize(q, inv, block_size=block_size, dtype=dtype)
    q2, _ = fp8_blockwise.quantize(deq, block_size=block_size)
    assert torch.equal(q.view(torch.uint8), q2.view(torch.uint8))


@given(spec=weight_specs, block_size=blocks)
def test_pow2_requantization_reaches_a_fixed_point_after_one_round(weight_from_seed, spec, block_size):
    w = weight_from_seed(*spec)

    # Not idempotent in one round: a block whose largest code rounds down to 224 = 448/2 gets
    # twice the scale when requantized. From then on its largest code is 448 and nothing moves.
    def round_trip(x):
        q, inv = fp8_blockwise.quantize(x, block_size=block_size, pow2_scale=True)
        return q, inv, fp8_blockwise.dequantize(q, inv, block_size=block_size, dtype=torch.float32)

    q1, inv1, d1 = round_trip(w)
    q2, inv2, d2 = round_trip(d1)
    q3, inv3, _ = round_trip(d2)
    assert torch.equal(q2.view(torch.uint8), q3.view(torch.uint8)) and torch.equal(inv2, inv3)
    changed = (inv1 != inv2).repeat_interleave(block_size[0], -2)[..., : w.shape[-2], :]
    changed = changed.repeat_interleave(block_size[1], -1)[..., : w.shape[-1]]
    assert torch.equal(q1.view(torch.uint8)[~changed], q2.view(torch.uint8)[~changed])
    assert torch.equal(inv2[inv1 != inv2], inv1[inv1 != inv2] / 2)


# ---------------------------------------------------------------- same bits on GPU
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("shape", [(2048, 7168), (4, 768, 2048), (300, 1000), (1, 4096), (4096, 1)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("pow2", [False, True])
def test_cuda_matches_cpu_bit_for_bit(make_weight, gen, shape, dtype, pow2):
    w = make_weight(shape, dtype, "transposed")
    w[..., ::97, ::13] *= 10.0 ** torch.randint(-44, 4, (1,), generator=gen).item()  # tiny or huge blocks
    for block_size in [(128, 128), (1, 128)]:
        q, inv = fp8_blockwise.quantize(w, block_size=block_size, pow2_scale=pow2)
        qc, invc = fp8_blockwise.quantize(w.cuda(), block_size=block_size, pow2_scale=pow2)
        assert torch.equal(qc.cpu().view(torch.uint8), q.view(torch.uint8))
        assert torch.equal(invc.cpu().view(torch.int32), inv.view(torch.int32))
        d = fp8_blockwise.dequantize(q, inv, block_size=block_size)
        dc = fp8_blockwise.dequantize(qc, invc, block_size=block_size)
        assert torch.equal(dc.cpu().view(torch.int16), d.view(torch.int16))


@pytest.mark.gpu
@needs_cuda
def test_cuda_scale_is_a_correctly_rounded_division(gen):
    amax = (
        (torch.rand(1_000_000, generator=gen, dtype=torch.float64) + 1)
        * 2.0 ** (torch.rand(1_000_000, generator=gen, dtype=torch.float64) * 260 - 140)
    ).float()
    got = fp8_blockwise.scale_from_amax(amax.cuda()).cpu().numpy()
    with np.errstate(over="ignore"):
        want = F32(448.0) / amax.numpy()
    want[np.isinf(want)] = FLT_MAX
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    inv = torch.ones_like(amax.cuda()) / torch.from_numpy(want).cuda()
    np.testing.assert_array_equal(inv.cpu().numpy(), F32(1.0) / want)
