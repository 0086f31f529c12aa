"""The compiled CPU kernel gives `fp8_blockwise.quantize`'s bits for every BF16 input it accepts."""

from __future__ import annotations

import os
import secrets

import pytest
import torch

from skyq.checkpoint import fp8_cpu_kernel
from skyq.quant import fp8_blockwise

pytestmark = pytest.mark.skipif(not fp8_cpu_kernel.available(), reason="no C compiler to build the kernel")


@pytest.fixture
def gen() -> torch.Generator:
    seed = int(os.environ.get("SKYQ_TEST_SEED", secrets.randbits(32)))
    print(f"SKYQ_TEST_SEED={seed}")
    return torch.Generator().manual_seed(seed)


def _finite_bf16(gen: torch.Generator, shape: tuple[int, int]) -> torch.Tensor:
    """Uniformly random BF16 bit patterns (every sign, exponent and mantissa), NaN/inf made zero."""
    w = torch.randint(-(1 << 15), 1 << 15, shape, generator=gen, dtype=torch.int16).view(torch.bfloat16)
    return torch.where(torch.isfinite(w), w, torch.zeros_like(w))


def _assert_reference_bits(w: torch.Tensor, block_size: tuple[int, int], pow2: bool) -> None:
    q, s = fp8_cpu_kernel.quantize_blockwise(w, block_size=block_size, pow2_scale=pow2)
    q_ref, s_ref = fp8_blockwise.quantize(w, block_size=block_size, pow2_scale=pow2)
    assert q.dtype == q_ref.dtype and q.shape == q_ref.shape and s.shape == s_ref.shape
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    assert torch.equal(s.view(torch.int32), s_ref.view(torch.int32))


def test_every_bf16_value_up_to_448_casts_like_torch():
    # Blocks of 1 x 128 each led by 448: scale 1, so every other element is cast as it is,
    # covering every e4m3 rounding tie, subnormal and the clamp boundary.
    values = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    values = values[torch.isfinite(values) & (values.float().abs() <= 448)]
    rows = -(-values.numel() // 127)
    body = torch.zeros(rows * 127, dtype=torch.bfloat16)
    body[: values.numel()] = values
    w = torch.cat([torch.full((rows, 1), 448.0, dtype=torch.bfloat16), body.view(rows, 127)], dim=1)
    _assert_reference_bits(w, (1, 128), pow2=False)


@pytest.mark.parametrize("block_size", [(128, 128), (96, 64), (1, 128), (7, 5)])
@pytest.mark.parametrize("pow2", [False, True])
def test_random_bit_patterns_and_edge_blocks(gen, block_size, pow2):
    for _ in range(3):
        n, k = (int(v) for v in torch.randint(1, 300, (2,), generator=gen))
        _assert_reference_bits(_finite_bf16(gen, (n, k)), block_size, pow2)


@pytest.mark.parametrize("magnitude", [1e-39, 1e-30, 1e-3, 1e30, 1e37])
def test_magnitudes_zero_blocks_and_signed_zeros(gen, magnitude):
    w = (torch.randn(260, 300, generator=gen) * magnitude).bfloat16()
    w[:128, :128] = 0.0
    w[128:256, 128:256] = -0.0
    w[200, :] = torch.finfo(torch.bfloat16).max
    for pow2 in (False, True):
        _assert_reference_bits(w, (128, 128), pow2)


def test_strided_rows(gen):
    w = (torch.randn(300, 520, generator=gen) * 0.02).bfloat16()[:, 7:407]
    assert w.stride() == (520, 1)
    _assert_reference_bits(w, (128, 128), pow2=False)


def test_non_finite_and_uncovered_inputs_are_declined(gen):
    w = torch.randn(130, 260, generator=gen).bfloat16()
    for bad in (float("nan"), float("inf"), float("-inf")):
        x = w.clone()
        x[129, 259] = bad
        assert fp8_cpu_kernel.quantize_blockwise(x, block_size=(128, 128), pow2_scale=False) is None
    for other in (w.half(), w.float(), w.t(), w[None], w[:0]):
        assert fp8_cpu_kernel.quantize_blockwise(other, block_size=(128, 128), pow2_scale=False) is None
