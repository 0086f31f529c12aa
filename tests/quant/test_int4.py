"""int4 against a numpy + ml_dtypes reference and compressed-tensors as an outside oracle."""

from __future__ import annotations

from types import SimpleNamespace

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from skyq.config.enums import Int4Grid
from skyq.quant import int4
from skyq.quant.errors import QuantizationError

F32 = np.float32
BF16 = ml_dtypes.bfloat16
LAYOUTS = ("contiguous", "transposed", "strided")
GRID_PARAMS = {"kimi": (7.0, -7, 7), "rtn": (7.5, -8, 7)}


# ---------------------------------------------------------------- independent reference
def ref_quantize(w: np.ndarray, g: int, grid: str) -> tuple[np.ndarray, np.ndarray]:
    divisor, qmin, qmax = GRID_PARAMS[grid]
    groups = w.astype(F32).reshape(*w.shape[:-1], -1, g)
    amax = np.abs(groups).max(axis=-1, keepdims=True)
    scale = (np.maximum(amax, F32(1e-10)) / F32(divisor)).astype(BF16)
    q = np.clip(np.rint(groups / scale.astype(F32)), qmin, qmax).astype(np.int8)  # rint: half to even
    return q.reshape(w.shape), scale[..., 0]


def ref_dequantize(q: np.ndarray, scale: np.ndarray, g: int) -> np.ndarray:
    s = np.repeat(scale.astype(F32), g, axis=-1)
    return (q.astype(F32) * s).astype(BF16)  # exact fp32 product, rounded once


def ref_pack(q: np.ndarray) -> np.ndarray:
    u = (q.astype(np.int64) + 8).reshape(*q.shape[:-1], -1, 8).astype(np.uint64)
    words = np.zeros(u.shape[:-1], dtype=np.uint64)
    for j in range(8):
        words |= u[..., j] << np.uint64(4 * j)
    return words.astype(np.uint32).view(np.int32)


@pytest.fixture(scope="module")
def ct() -> SimpleNamespace:
    """compressed-tensors, the outside oracle; imported here so a GPU-only run can go without it."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    def scheme(group_size: int, symmetric: bool = True) -> QuantizationScheme:
        args = QuantizationArgs(
            num_bits=4, type="int", symmetric=symmetric, strategy="group", group_size=group_size
        )
        return QuantizationScheme(targets=["Linear"], weights=args)

    return SimpleNamespace(
        compressor=PackedQuantizationCompressor, pack=pack_to_int32, unpack=unpack_from_int32, scheme=scheme
    )


def assert_matches_reference(w: torch.Tensor, g: int, grid: str) -> None:
    q, scale = int4.quantize(w, group_size=g, grid=grid)
    ref_q, ref_scale = ref_quantize(w.float().numpy(), g, grid)
    assert q.dtype == torch.int8 and q.shape == w.shape
    assert scale.dtype == torch.bfloat16 and scale.shape == (*w.shape[:-1], w.shape[-1] // g)
    np.testing.assert_array_equal(q.numpy(), ref_q)
    np.testing.assert_array_equal(scale.view(torch.uint16).numpy(), ref_scale.view(np.uint16))
    deq = int4.dequantize(q, scale, group_size=g)
    np.testing.assert_array_equal(
        deq.view(torch.uint16).numpy(), ref_dequantize(ref_q, ref_scale, g).view(np.uint16)
    )


SHAPES = [((4, 128), 128), ((16, 256), 32), ((1, 32), 32), ((3, 8, 64), 32), ((7, 1), 1), ((33, 96), 32)]


# ---------------------------------------------------------------- bit-exact agreement
@pytest.mark.parametrize("shape,g", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("grid", ["kimi", "rtn"])
def test_quantize_matches_reference_across_shapes_and_dtypes(make_weight, shape, g, dtype, grid):
    assert_matches_reference(make_weight(shape, dtype), g, grid)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_quantize_matches_reference_for_non_contiguous_views(make_weight, layout):
    assert_matches_reference(make_weight((2, 40, 96), torch.bfloat16, layout), 32, "kimi")


def test_grid_accepts_the_enum_and_its_string_value(make_weight):
    w = make_weight((8, 64), torch.bfloat16)
    for grid in Int4Grid:
        a = int4.quantize(w, group_size=32, grid=grid)
        b = int4.quantize(w, group_size=32, grid=grid.value)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert int4.GRIDS[Int4Grid.kimi] == (7.0, -7, 7) and int4.GRIDS[Int4Grid.rtn] == (7.5, -8, 7)


def test_kimi_grid_puts_plus_or_minus_7_in_every_group(make_weight):
    w = make_weight((64, 256), torch.bfloat16)
    q, _ = int4.quantize(w, group_size=32, grid="kimi")
    assert q.abs().max() == 7 and q.reshape(64, 8, 32).abs().amax(-1).eq(7).all()


# ---------------------------------------------------------------- packing
@pytest.mark.parametrize("shape", [(5, 8), (16, 256), (2, 3, 64)])
def test_pack_matches_reference_and_compressed_tensors(ct, gen, shape):
    q = torch.randint(-8, 8, shape, generator=gen, dtype=torch.int8)
    packed = int4.pack(q)
    assert packed.dtype == torch.int32 and packed.shape == (*shape[:-1], shape[-1] // 8)
    np.testing.assert_array_equal(packed.numpy(), ref_pack(q.numpy()))
    assert torch.equal(packed, ct.pack(q, 4))
    assert torch.equal(ct.unpack(packed, 4, torch.Size(shape)), q)
    assert torch.equal(int4.unpack(packed, shape[-1]), q)


def test_element_zero_is_the_lowest_nibble_and_words_are_twos_complement():
    q = torch.tensor([[-8, -7, -6, -5, -4, -3, -2, 7]], dtype=torch.int8)  # u = 0..6, 15
    assert int4.pack(q).item() == np.array([0xF6543210], dtype=np.uint32).view(np.int32).item()
    assert int4.pack(torch.full((1, 8), 7, dtype=torch.int8)).item() == -1


def test_golden_pack_vectors_of_compressed_tensors():
    # compressed-tensors tests/test_compressors: [-8..-1] -> 1985229328, [1, 2, 3, 4] -> 52137, [1] -> 9
    # (short words padded with nibble 0); zero points are packed along N, so a column exercises the padding.
    assert int4.pack(torch.arange(-8, 0, dtype=torch.int8)[None]).item() == 1985229328
    assert int4.pack_zero_point(torch.tensor([[1], [2], [3], [4]], dtype=torch.int8)).item() == 52137
    assert int4.pack_zero_point(torch.tensor([[1]], dtype=torch.int8)).item() == 9


@pytest.mark.parametrize("n", [1, 7, 8, 9, 20])
def test_zero_point_packing_along_n_matches_compressed_tensors(ct, gen, n):
    zp = torch.randint(-8, 8, (n, 3), generator=gen, dtype=torch.int8)
    packed = int4.pack_zero_point(zp)
    assert packed.shape == (-(-n // 8), 3)
    assert torch.equal(packed, ct.pack(zp, 4, packed_dim=0))


# ---------------------------------------------------------------- compressed-tensors as an oracle
@pytest.mark.parametrize("shape,g", [((24, 256), 128), ((40, 96), 32), ((8, 64), 64)])
@pytest.mark.parametrize("grid", ["kimi", "rtn"])
def test_compressed_tensors_decompresses_our_w4a16_to_our_dequant(ct, make_weight, shape, g, grid):
    w = make_weight(shape, torch.bfloat16)
    q, scale = int4.quantize(w, group_size=g, grid=grid)
    packed, weight_shape = int4.pack(q), int4.weight_shape_tensor(*shape)
    assert weight_shape.dtype == torch.int64 and weight_shape.tolist() == list(shape)
    ct = ct.compressor.decompress(
        {"weight_packed": packed, "weight_scale": scale, "weight_shape": weight_shape}, ct.scheme(g)
    )
    ours = int4.dequantize_packed(packed, scale, weight_shape)
    assert ct["weight"].dtype == ours.dtype == torch.bfloat16
    assert torch.equal(ct["weight"].view(torch.int16), ours.view(torch.int16))
    assert torch.equal(ours, int4.dequantize(q, scale, group_size=g))
    assert torch.equal(int4.dequantize_packed(packed, scale, list(shape), group_size=g), ours)


def test_dequantize_packed_handles_expert_stacks(ct, make_weight):
    w = make_weight((3, 16, 64), torch.bfloat16)
    q, scale = int4.quantize(w, group_size=32)
    packed = int4.pack(q)
    assert torch.equal(ct.unpack(packed, 4, torch.Size(w.shape)), q)
    assert torch.equal(
        int4.dequantize_packed(packed, scale, [16, 64]), int4.dequantize(q, scale, group_size=32)
    )


@pytest.mark.parametrize("shape,g", [((20, 64), 32), ((16, 256), 128), ((9, 32), 32)])
def test_asymmetric_checkpoint_from_compressed_tensors_dequantizes_like_compressed_tensors(
    ct, make_weight, shape, g
):
    w = make_weight(shape, torch.bfloat16)
    _, scale, zp = int4.quantize_asymmetric(w, group_size=g)
    scheme = ct.scheme(g, symmetric=False)
    compressed = ct.compressor.compress({"weight": w, "weight_scale": scale, "weight_zero_point": zp}, scheme)
    assert compressed["weight_zero_point"].shape == (-(-shape[0] // 8), shape[1] // g)
    ct = ct.compressor.decompress(dict(compressed), scheme)
    ours = int4.dequantize_asymmetric(
        compressed["weight_packed"],
        compressed["weight_scale"],
        compressed["weight_zero_point"],
        compressed["weight_shape"],
    )
    assert torch.equal(ct["weight"].view(torch.int16), ours.view(torch.int16))


def test_our_asymmetric_inputs_round_trip_through_compressed_tensors(ct, make_weight):
    w = make_weight((12, 64), torch.bfloat16)
    q, scale, zp = int4.quantize_asymmetric(w, group_size=32)
    zp_packed = int4.pack_zero_point(zp)
    assert torch.equal(zp_packed, ct.pack(zp, 4, packed_dim=0))
    state = {
        "weight_packed": int4.pack(q),
        "weight_scale": scale,
        "weight_zero_point": zp_packed,
        "weight_shape": int4.weight_shape_tensor(12, 64),
    }
    ct = ct.compressor.decompress(state, ct.scheme(32, symmetric=False))
    ours = int4.dequantize_asymmetric(state["weight_packed"], scale, zp_packed, [12, 64])
    assert torch.equal(ct["weight"], ours)
    assert (ours.float() - w.float()).abs().max() <= scale.float().max() * 0.6


# ---------------------------------------------------------------- extremes
def test_all_zero_groups_get_the_floored_scale_and_zero_codes():
    w = torch.zeros(4, 64, dtype=torch.bfloat16)
    w[0, :32] = 1.0
    for grid in ("kimi", "rtn"):
        q, scale = int4.quantize(w, group_size=32, grid=grid)
        divisor = GRID_PARAMS[grid][0]
        assert scale[1:].eq(torch.tensor(1e-10 / divisor).to(torch.bfloat16)).all()
        assert q[1:].eq(0).all() and int4.dequantize(q, scale, group_size=32)[1:].eq(0).all()
        assert_matches_reference(w, 32, grid)


def test_single_nonzero_and_subnormals_and_huge_values(gen):
    w = torch.zeros(6, 64)
    w[0, 5] = -2.5
    w[1] = torch.randn(64, generator=gen) * 1e-40
    w[2] = torch.randn(64, generator=gen) * 1e-12
    w[3] = torch.linspace(447, 480, 64)
    w[4, 7] = 1e4
    w[5] = 3e38
    for grid in ("kimi", "rtn"):
        q, scale = int4.quantize(w, group_size=32, grid=grid)
        assert (
            q[0, 5] == -7
            and torch.isfinite(int4.dequantize(q, scale, group_size=32, dtype=torch.float32)).all()
        )
        assert_matches_reference(w, 32, grid)


# ---------------------------------------------------------------- refusals
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_input_is_refused_naming_the_tensor(bad):
    w = torch.ones(4, 32, dtype=torch.bfloat16)
    w[0, 0] = bad
    with pytest.raises(QuantizationError, match=r"experts\.3\.down_proj: .*1 (NaN|inf)"):
        int4.quantize(w, group_size=32, name="experts.3.down_proj")
    with pytest.raises(QuantizationError, match=r"experts\.3\.down_proj"):
        int4.quantize_asymmetric(w, group_size=32, name="experts.3.down_proj")


def test_impossible_shapes_and_codes_are_refused_with_the_arithmetic():
    with pytest.raises(QuantizationError, match=r"K % group_size == 0, but K = 100 = 0 \* 128 \+ 100"):
        int4.quantize(torch.ones(2, 100), group_size=128)
    with pytest.raises(QuantizationError, match="unknown INT4 grid"):
        int4.quantize(torch.ones(2, 32), group_size=32, grid="awq")
    with pytest.raises(QuantizationError, match=r"K = 12 = 1 \* 8 \+ 4"):
        int4.pack(torch.zeros(2, 12, dtype=torch.int8))
    with pytest.raises(QuantizationError, match="outside the int4 range"):
        int4.pack(torch.full((2, 8), 8, dtype=torch.int8))
    q, scale = int4.quantize(torch.ones(4, 64), group_size=32)
    packed = int4.pack(q)
    with pytest.raises(QuantizationError, match=r"ceil\(72/8\) = 9 words"):
        int4.unpack(packed, 72)
    with pytest.raises(QuantizationError, match="N = 5 rows"):
        int4.dequantize_packed(packed, scale, [5, 64])
    with pytest.raises(QuantizationError, match=r"expected shape \(4, 2\)"):
        int4.dequantize(q, scale[:, :1], group_size=32)
    with pytest.raises(QuantizationError, match="weight_scale"):
        int4.dequantize(q, scale * float("nan"), group_size=32)


# ---------------------------------------------------------------- properties
weight_specs = st.tuples(
    st.integers(0, 2**32 - 1),
    st.builds(
        lambda lead, n, ng: (*lead, n, 32 * ng),
        st.sampled_from([(), (2,)]),
        st.integers(1, 40),
        st.integers(1, 4),
    ),
    st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
    st.sampled_from(LAYOUTS),
)


@given(spec=weight_specs, grid=st.sampled_from(["kimi", "rtn"]))
def test_round_trip_error_is_within_half_a_step(weight_from_seed, spec, grid):
    w = weight_from_seed(*spec)
    q, scale = int4.quantize(w, group_size=32, grid=grid)
    deq = int4.dequantize(q, scale, group_size=32, dtype=torch.float32).double()
    s = scale.double().repeat_interleave(32, -1)
    # Half a step, plus the rtn clamp of +7.5 to 7 with a bf16-rounded scale, plus bf16 output rounding.
    bound = (0.5 + 2.0**-5) * s + deq.abs() * 2.0**-8
    assert ((deq - w.double()).abs() <= bound).all()


@given(spec=weight_specs, g=st.sampled_from([32, 16]))
def test_kimi_grid_requantization_gives_the_same_codes(weight_from_seed, spec, g):
    w = weight_from_seed(*spec)
    q, scale = int4.quantize(w, group_size=g, grid="kimi")
    q2, _ = int4.quantize(int4.dequantize(q, scale, group_size=g), group_size=g, grid="kimi")
    assert torch.equal(q, q2)


def test_rtn_grid_is_not_its_own_fixed_point():
    # A -8 code raises the next amax to 8 * scale: requantizing shifts the grid (reference §2.2).
    w = torch.tensor([[-7.5] + [3.0] * 31])
    q, scale = int4.quantize(w, group_size=32, grid="rtn")
    q2, _ = int4.quantize(int4.dequantize(q, scale, group_size=32), group_size=32, grid="rtn")
    assert q[0, 0] == -8 and not torch.equal(q, q2)


# ---------------------------------------------------------------- same bits on GPU
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("shape,g", [((2048, 7168), 32), ((4, 768, 2048), 128), ((8, 32), 32)])
@pytest.mark.parametrize("grid", ["kimi", "rtn"])
def test_cuda_matches_cpu_bit_for_bit(make_weight, shape, g, grid):
    w = make_weight(shape, torch.bfloat16, "transposed")
    q, scale = int4.quantize(w, group_size=g, grid=grid)
    qc, scalec = int4.quantize(w.cuda(), group_size=g, grid=grid)
    assert torch.equal(qc.cpu(), q) and torch.equal(scalec.cpu().view(torch.int16), scale.view(torch.int16))
    packed, packedc = int4.pack(q), int4.pack(qc)
    assert torch.equal(packedc.cpu(), packed) and torch.equal(int4.unpack(packedc, shape[-1]).cpu(), q)
    d = int4.dequantize_packed(packed, scale, shape[-2:])
    dc = int4.dequantize_packed(packedc, scalec, shape[-2:])
    assert torch.equal(dc.cpu().view(torch.int16), d.view(torch.int16))
