"""Asymmetric INT4 refuses a group whose range its bf16 scale and codes cannot hold (nothing inf
is returned), and quantizes every range it accepts to finite values."""

from __future__ import annotations

import pytest
import torch

from skyq.quant import int4
from skyq.quant.errors import QuantizationError


@pytest.mark.parametrize(
    ("hi", "lo"),
    [(3e38, -3e38), (2e38, -1.402e38)],  # max - min overflows fp32; finite but 15 * scale past bf16's max
    ids=["span-inf", "codes-past-bf16"],
)
def test_a_range_the_grid_cannot_hold_is_refused_naming_row_and_columns(gen, hi, lo):
    w = torch.randn(2, 5, 64, generator=gen)
    w[1, 3, 40], w[1, 3, 41] = hi, lo
    with pytest.raises(
        QuantizationError, match=r"^up\.weight\[1, 3, 32:64\]: asymmetric INT4 range .*1 group"
    ):
        int4.quantize_asymmetric(w, group_size=32, name="up.weight")


def test_the_largest_accepted_ranges_round_trip_finite(gen):
    w = torch.randn(4, 64, generator=gen).to(torch.bfloat16)
    w[0, 0], w[0, 1] = 1.1e38, -1.1e38
    w[2, 33] = 3.3e38  # one-sided: min clamps to 0
    q, scale, zp = int4.quantize_asymmetric(w, group_size=32, name="w")
    assert torch.isfinite(scale.float()).all()
    packed, zp_packed = int4.pack(q), int4.pack_zero_point(zp)
    back = int4.dequantize_asymmetric(packed, scale, zp_packed, [4, 64], name="w")
    assert torch.isfinite(back.float()).all()
