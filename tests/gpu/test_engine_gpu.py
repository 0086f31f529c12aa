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
    kernel = quantized_linear.fp8_linear.fp8_weight_only_linear
    monkeypatch.setattr(quantized_linear.fp8_linear, "fp8_weight_only_linear",
                        lambda *a, **k: calls.append(1) or kernel(*a, **k))  # fmt: skip
    x = torch.randn(rows, 2048, generator=gen).to(torch.bfloat16).cuda()
    y = layer(x)
    assert bool(calls) == (rows <= quantized_linear.DECODE_MAX_ROWS)
    dequant = strategy.deserialize(NAME, layer.wire(), role=Role.routed_expert, dtype=torch.float32)
    ref = x.float() @ dequant.T
    assert y.dtype == torch.bfloat16 and y.shape == (rows, 768)
    assert float((y.float() - ref).norm() / ref.norm()) < 1e-2


@pytest.mark.parametrize("kind", ["fp8", "bf16"])
def test_grouped_experts_need_no_host_sync_and_replay_from_a_cuda_graph(gen, kind):
    """The stacked experts' decode forward (FP8: the grouped Gluon kernel; bf16: torch._grouped_mm)
    captures into a CUDA graph (no host sync: routing sorted and offset on the device) and its
    replay gives the eager call's bits; the eager call agrees with the per-expert loop within the
    kernels' rounding."""
    import torch.nn.functional as F

    from skyq.rollout.quantized_linear import ExpertMLP, WireExperts

    strategy = get_strategy(PrecisionConfig(name=Precision.fp8_blockwise))
    shapes = {"gate_proj": (384, 512), "up_proj": (384, 512), "down_proj": (512, 384)}
    experts = []
    for e in range(16):
        linears = []
        for proj, shape in shapes.items():
            name = f"model.layers.0.mlp.experts.{e}.{proj}.weight"
            w = torch.randn(shape, generator=gen) * 0.05
            if kind == "bf16":
                lin = torch.nn.Linear(shape[1], shape[0], bias=False, dtype=torch.bfloat16, device="cuda")
                lin.requires_grad_(False).weight.copy_(w)
                linears.append(lin)
                continue
            lin = WireLinear(name, Role.routed_expert, strategy.wire_specs(name, shape, Role.routed_expert), strategy,
                             activation=None).cuda()  # fmt: skip
            for wire_name, t in strategy.serialize(name, w, role=Role.routed_expert).items():
                lin.get_buffer(wire_name.removeprefix(lin.stem)).copy_(t)
            linears.append(lin)
        experts.append(ExpertMLP(*linears, act_fn=F.silu))
    block = WireExperts(experts)
    x = torch.randn(12, 512, generator=gen).to(torch.bfloat16).cuda()
    idx = torch.stack([torch.randperm(15, generator=gen)[:4] for _ in range(12)]).cuda()
    wts = torch.softmax(torch.randn(12, 4, generator=gen), -1).to(torch.bfloat16).cuda()
    loop = block(x, idx, wts)
    assert block.stack() and block._grouped_applies(x, 4)
    eager = block(x, idx, wts)
    assert float((eager.float() - loop.float()).norm() / loop.float().norm()) < 1e-2
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        block(x, idx, wts)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = block(x, idx, wts)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
