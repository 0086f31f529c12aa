"""mxfp8 against an independent numpy + ml_dtypes reference (frexp-based exponents, a block loop)."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from skyq.quant import mxfp8
from skyq.quant.errors import QuantizationError

F32 = np.float32
E4M3 = ml_dtypes.float8_e4m3fn
LAYOUTS = ("contiguous", "transposed", "strided")


# ---------------------------------------------------------------- independent reference
def ref_exponent(amax: float) -> int:
    """ceil(log2(t)) of the fp32 `t = amax * fp32(1/448)`, from math.frexp in float64."""
    t = float(F32(amax) * F32(1.0 / 448.0))
    if t == 0:
        return -127
    mantissa, exponent = math.frexp(t)  # t = mantissa * 2^exponent, mantissa in [0.5, 1)
    ceil_log2 = exponent - 1 if mantissa == 0.5 else exponent
    return min(max(ceil_log2, -127), 127)


def ref_quantize(w: np.ndarray, allow_pad: bool = False) -> tuple[np.ndarray, np.ndarray]:
    *lead, n, k = w.shape
    rows = w.reshape(-1, k).astype(F32)
    nb = -(-k // 32)
    q = np.zeros(rows.shape, dtype=E4M3)
    scale = np.zeros((rows.shape[0], nb), dtype=np.uint8)
    for r in range(rows.shape[0]):
        for b in range(nb):
            block = rows[r, b * 32 : (b + 1) * 32]
            e = ref_exponent(np.abs(block).max())
            q[r, b * 32 : (b + 1) * 32] = np.clip(block * F32(2.0**-e), -448, 448).astype(E4M3)
            scale[r, b] = e + 127
    return q.view(np.uint8).reshape(w.shape), scale.reshape(*lead, n, nb)


def ref_dequantize(q_bits: np.ndarray, scale: np.ndarray) -> np.ndarray:
    k = q_bits.shape[-1]
    mult = np.repeat(np.ldexp(F32(1.0), scale.astype(np.int32) - 127).astype(F32), 32, axis=-1)[..., :k]
    return q_bits.view(E4M3).astype(F32) * mult


def bits(q: torch.Tensor) -> np.ndarray:
    return q.view(torch.uint8).numpy()


def assert_matches_reference(w: torch.Tensor, allow_pad: bool = False) -> None:
    q, scale = mxfp8.quantize(w, allow_pad=allow_pad)
    ref_q, ref_scale = ref_quantize(w.float().numpy())
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape and scale.dtype == torch.uint8
    np.testing.assert_array_equal(scale.numpy(), ref_scale)
    np.testing.assert_array_equal(bits(q), ref_q)
    deq = mxfp8.dequantize(q, scale, dtype=torch.float32)
    np.testing.assert_array_equal(
        deq.numpy().view(np.uint32), ref_dequantize(ref_q, ref_scale).view(np.uint32)
    )


# ---------------------------------------------------------------- exponent rule
def test_exponent_matches_frexp_ceil_log2_over_the_whole_fp32_range(gen):
    exponents = torch.rand(100_000, generator=gen, dtype=torch.float64) * 270 - 150
    amax = ((torch.rand(100_000, generator=gen, dtype=torch.float64) + 1) * 2.0**exponents).float()
    k = torch.arange(-140, 120, dtype=torch.float64)
    special = torch.cat([448 * 2.0**k, 448 * 2.0**k * (1 + 2.0**-23), 448 * 2.0**k * (1 - 2.0**-24), k * 0])
    amax = torch.cat(
        [amax, special.float(), torch.tensor([1e-45, 2.0**-149, torch.finfo(torch.float32).max])]
    )
    got = mxfp8.e8m0_exponent(amax)
    assert got.dtype == torch.int32
    want = [ref_exponent(a) for a in amax.tolist()]
    assert got.tolist() == want


def test_exponent_table_matches_transformer_engine():
    # reference/formats.md §4.2: TE / cuBLAS "RCEIL" column.
    amax = torch.tensor([447.0, 448.0, 449.0, 511.0, 512.0, 896.0, 0.0])
    assert mxfp8.e8m0_exponent(amax).tolist() == [0, 0, 1, 1, 1, 1, -127]


def test_torch_e8m0_cast_is_not_the_round_up_rule(gen):
    # torch's float8_e8m0fnu cast rounds to nearest, so it would give 2^0 for t = 1.1 where TE
    # gives 2^1 (and elements above 448 would saturate). Our exponents follow the reference.
    t = torch.rand(10_000, generator=gen) * 4 + 0.01
    amax = t * 448
    ours = mxfp8.e8m0_exponent(amax)
    t_fp32 = amax * torch.full_like(amax, 1 / 448)
    torch_cast = t_fp32.to(torch.float8_e8m0fnu).view(torch.uint8).to(torch.int32) - 127
    want = torch.tensor([ref_exponent(a) for a in amax.tolist()], dtype=torch.int32)
    assert torch.equal(ours, want)
    assert (torch_cast != want).float().mean() > 0.2


def test_exp2_is_exact_over_the_e8m0_range():
    e = torch.arange(-127, 128, dtype=torch.int32)
    np.testing.assert_array_equal(mxfp8.exp2(e).numpy(), np.ldexp(F32(1.0), e.numpy()).astype(F32))


# ---------------------------------------------------------------- bit-exact agreement
SHAPES = [(4, 32), (64, 96), (1, 32), (32, 160), (3, 17, 64), (2, 1, 32)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_quantize_matches_reference_across_shapes_and_dtypes(make_weight, shape, dtype):
    assert_matches_reference(make_weight(shape, dtype))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_quantize_matches_reference_for_non_contiguous_views(make_weight, layout):
    assert_matches_reference(make_weight((2, 70, 96), torch.bfloat16, layout))


@pytest.mark.parametrize("shape", [(5, 1), (7, 33), (1, 1), (3, 2, 95)])
def test_allow_pad_pads_the_last_block_for_its_max_only(make_weight, shape):
    w = make_weight(shape, torch.bfloat16)
    q, scale = mxfp8.quantize(w, allow_pad=True)
    assert scale.shape == (*shape[:-1], math.ceil(shape[-1] / 32))
    assert_matches_reference(w, allow_pad=True)


def test_dequantize_to_bf16_is_the_exact_product_rounded_once(make_weight):
    w = make_weight((64, 96), torch.float32)
    q, scale = mxfp8.quantize(w)
    got = mxfp8.dequantize(q, scale)
    want = ref_dequantize(bits(q), scale.numpy()).astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(got.view(torch.uint16).numpy(), want.view(np.uint16))


# ---------------------------------------------------------------- extremes
def test_all_zero_blocks_get_exponent_minus_127_and_zero_codes():
    w = torch.zeros(4, 64)
    w[0, :32] = 1.0
    q, scale = mxfp8.quantize(w)
    assert scale[1:].eq(0).all() and scale[0, 1] == 0
    assert q.float()[1:].eq(0).all()
    assert mxfp8.dequantize(q, scale).isfinite().all()
    assert_matches_reference(w)


def test_single_nonzero_element_and_subnormals(gen):
    w = torch.zeros(8, 64)
    w[3, 40] = -2.5
    w[5] = torch.randn(64, generator=gen) * 1e-40
    w[6] = torch.randn(64, generator=gen) * 2.0**-126
    w[7, 7] = 1e-45
    assert_matches_reference(w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_large_values_saturate_and_never_give_nan(dtype):
    w = torch.linspace(447, 480, 4 * 64).reshape(4, 64)
    w[1] *= -1
    w[2, 3] = 1e4
    w[3] = 3e38
    w = w.to(dtype)
    q, scale = mxfp8.quantize(w)
    assert not q.float().isnan().any() and (scale != 0xFF).all()
    assert_matches_reference(w)


# ---------------------------------------------------------------- refusals
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_input_is_refused_naming_the_tensor(bad):
    w = torch.ones(4, 32, dtype=torch.bfloat16)
    w[2, 2] = bad
    with pytest.raises(QuantizationError, match=r"experts\.0\.w2: .*1 (NaN|inf)"):
        mxfp8.quantize(w, name="experts.0.w2")


def test_k_not_a_multiple_of_32_is_refused_with_the_arithmetic():
    with pytest.raises(QuantizationError, match=r"w: MXFP8 needs K % 32 == 0, but K = 100 = 3 \* 32 \+ 4"):
        mxfp8.quantize(torch.ones(2, 100), name="w")


def test_dequantize_refuses_nan_scales_and_wrong_shapes():
    q, scale = mxfp8.quantize(torch.ones(2, 64))
    bad = scale.clone()
    bad[0, 0] = 0xFF
    with pytest.raises(QuantizationError, match="0xFF"):
        mxfp8.dequantize(q, bad)
    with pytest.raises(QuantizationError, match=r"expected shape \(2, 2\)"):
        mxfp8.dequantize(q, scale[:, :1])
    with pytest.raises(QuantizationError, match="dtype"):
        mxfp8.dequantize(q, scale.to(torch.int32))


# ---------------------------------------------------------------- properties
weight_specs = st.tuples(
    st.integers(0, 2**32 - 1),
    st.builds(
        lambda lead, n, nb: (*lead, n, 32 * nb),
        st.sampled_from([(), (3,)]),
        st.integers(1, 40),
        st.integers(1, 5),
    ),
    st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
    st.sampled_from(LAYOUTS),
)


@given(spec=weight_specs)
def test_round_trip_error_is_within_half_an_e4m3_step(weight_from_seed, spec):
    w = weight_from_seed(*spec)
    q, scale = mxfp8.quantize(w)
    deq = mxfp8.dequantize(q, scale, dtype=torch.float32).double()
    step = torch.ldexp(torch.ones(1, dtype=torch.float64), scale.double() - 127).repeat_interleave(32, -1)
    x = w.double()
    # In units of 2^e: half an e4m3 step is 2^-4 relative (normals), 2^-10 absolute (subnormals);
    # t = amax * fp32(1/448) can round down by an ulp, so the block max may saturate at 448.
    bound = torch.maximum(x.abs() / step * 2.0**-4, torch.full_like(x, 2.0**-10)) * step * (1 + 1e-6)
    assert ((deq - x).abs() <= bound).all()


# ---------------------------------------------------------------- same bits on GPU
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("shape", [(2048, 7168), (4, 768, 2048), (1, 32), (300, 96)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_matches_cpu_bit_for_bit(make_weight, gen, shape, dtype):
    w = make_weight(shape, dtype, "strided")
    w[..., ::97, ::13] *= 10.0 ** torch.randint(-44, 4, (1,), generator=gen).item()  # tiny or huge blocks
    q, scale = mxfp8.quantize(w)
    qc, scalec = mxfp8.quantize(w.cuda())
    assert torch.equal(qc.cpu().view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(scalec.cpu(), scale)
    assert torch.equal(
        mxfp8.dequantize(qc, scalec).cpu().view(torch.int16), mxfp8.dequantize(q, scale).view(torch.int16)
    )


@pytest.mark.gpu
@needs_cuda
def test_cuda_exponent_matches_cpu_over_the_whole_fp32_range(gen):
    amax = (
        (torch.rand(1_000_000, generator=gen, dtype=torch.float64) + 1)
        * 2.0 ** (torch.rand(1_000_000, generator=gen, dtype=torch.float64) * 270 - 150)
    ).float()
    assert torch.equal(mxfp8.e8m0_exponent(amax.cuda()).cpu(), mxfp8.e8m0_exponent(amax))
    e = torch.arange(-127, 128, dtype=torch.int32)
    assert torch.equal(mxfp8.exp2(e.cuda()).cpu(), mxfp8.exp2(e))
