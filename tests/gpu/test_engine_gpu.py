"""The embedded engine's FP8 linear on the GPU: decode-sized inputs go through the weight-only kernel
(e4m3 read in-kernel, no dequantized weight), larger ones through dequantize + GEMM; both match
the fp32 product of the dequantized weight."""

from __future__ import annotations

import pytest
import torch

from skyq.config.enums import Precision
from skyq.config.schema import PrecisionConfig
from skyq.quant.layouts import Role
from skyq.quant.strategies import get_strategy
from skyq.rollout import quantized_linear
from skyq.rollout.quantized_linear import WireLinear

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
NAME = "model.layers.0.mlp.experts.0.down_proj.weight"


@pytest.mark.parametrize("rows", [1, 7, 64, 65, 300])
def test_fp8_wire_linear_decodes_from_e4m3(make_weight, gen, rows, monkeypatch):
    strategy = get_strategy(PrecisionConfig(name=Precision.fp8_blockwise))
    w = make_weight((768, 2048), torch.float32)
    layer = WireLinear(NAME, Role.routed_expert, strategy.wire_specs(NAME, (768, 2048), Role.routed_expert),
                       strategy, activation=None).cuda()  # fmt: skip
    for name, t in strategy.serialize(NAME, w, role=Role.routed_expert).items():
        layer.get_buffer(name.removeprefix(layer.stem)).copy_(t)
    calls = []
    kernel = quantized_linear.dispatch.fp8_weight_only_linear
    monkeypatch.setattr(quantized_linear.dispatch, "fp8_weight_only_linear",
                        lambda *a, **k: calls.append(1) or kernel(*a, **k))  # fmt: skip
    x = torch.randn(rows, 2048, generator=gen).to(torch.bfloat16).cuda()
    y = layer(x)
    assert bool(calls) == (rows <= quantized_linear.DECODE_MAX_ROWS)
    dequant = strategy.deserialize(NAME, layer.wire(), role=Role.routed_expert, dtype=torch.float32)
    ref = x.float() @ dequant.T
    assert y.dtype == torch.bfloat16 and y.shape == (rows, 768)
    assert float((y.float() - ref).norm() / ref.norm()) < 1e-2
