"""Linears that read one input (q/k/v) as one stacked weight (`SharedInput`), on the CPU: the stack
holds the members' values and their tensors are views of it; with the decode-size condition
forced (on CUDA it is a bf16 input of <= DECODE_MAX_ROWS rows), the first member's call computes all
three outputs with one activation quantization and one weight-only launch, the others get slices;
any other call pattern falls back to each member's own forward."""

from __future__ import annotations

import pytest
import torch

from skyq.config.enums import Precision
from skyq.config.schema import PrecisionConfig
from skyq.quant.fake_quant import activation_fake_quant
from skyq.quant.layouts import Role
from skyq.quant.strategies import get_strategy
from skyq.rollout import quantized_linear
from skyq.rollout.quantized_linear import SharedInput, WireLinear, plain_linear, rows_stackable

K = 256


def _fp8_members(gen: torch.Generator, rows=(256, 128, 128)) -> list[WireLinear]:
    cfg = PrecisionConfig(name=Precision.fp8_blockwise)
    strategy = get_strategy(cfg)
    members = []
    for p, n in zip(("q_proj", "k_proj", "v_proj"), rows, strict=True):
        name = f"model.layers.0.self_attn.{p}.weight"
        lin = WireLinear(name, Role.attention, strategy.wire_specs(name, (n, K), Role.attention), strategy,
                         activation_fake_quant(cfg))  # fmt: skip
        for wire_name, t in strategy.serialize(
            name, torch.randn(n, K, generator=gen) * 0.05, role=Role.attention
        ).items():
            lin.get_buffer(wire_name.removeprefix(lin.stem)).copy_(t)
        members.append(lin)
    return members


def test_members_become_views_of_one_stack_with_their_values():
    gen = torch.Generator().manual_seed(0)
    members = _fp8_members(gen)
    before = [{k: v.clone() for k, v in m.state_dict().items()} for m in members]
    group = SharedInput(members)
    assert group.weight.shape == (512, K) and group.scale.shape == (4, 2)
    for m, b, row in zip(members, before, group.bounds, strict=False):
        assert all(torch.equal(b[k], v) for k, v in m.state_dict().items())
        assert m.get_buffer("weight").data_ptr() == group.weight[row].data_ptr()
    members[2].get_buffer("weight_scale_inv").fill_(0.25)  # a weight load into a member lands in the stack
    assert bool((group.scale[3] == 0.25).all())


def test_the_first_call_computes_all_members_in_one_launch(monkeypatch):
    gen = torch.Generator().manual_seed(1)
    members = _fp8_members(gen)
    x = torch.randn(3, K, generator=gen).to(torch.bfloat16)
    own = [m(x) for m in members]  # before grouping: each member on its own
    group = SharedInput(members)
    monkeypatch.setattr(SharedInput, "applies", lambda self, x: True)  # CUDA's decode-size condition
    launches = []
    real = quantized_linear.fp8_linear.fp8_weight_only_linear
    monkeypatch.setattr(quantized_linear.fp8_linear, "fp8_weight_only_linear",
                        lambda *a, **k: launches.append(a[1].shape) or real(*a, **k))  # fmt: skip
    q, k, v = (m(x) for m in members)
    assert launches == [(512, K)]  # one launch over the stacked weight
    for got, ref in zip((q, k, v), own, strict=True):
        assert got.shape == ref.shape
        torch.testing.assert_close(got.float(), ref.float(), rtol=1e-2, atol=1e-3)
    assert group._x is None  # the last member released the shared output
    # another input for k (not the call pattern): k computes on its own (on the CPU: dequantize + F.linear)
    launches.clear()
    members[0](x)
    assert torch.equal(members[1](x.clone()), own[1])
    assert launches == [(512, K)]


def test_groups_need_whole_scale_blocks_and_one_kind_of_linear():
    gen = torch.Generator().manual_seed(2)
    assert not rows_stackable(_fp8_members(gen, rows=(200, 128, 128)))  # q's rows end inside a block
    assert rows_stackable(_fp8_members(gen, rows=(256, 128, 100)))  # the last member may end anywhere
    bf16 = [plain_linear((n, K), torch.bfloat16) for n in (64, 32, 32)]
    assert rows_stackable(bf16)
    assert not rows_stackable([*_fp8_members(gen)[:2], bf16[2]])
    with pytest.raises(ValueError, match="cannot share one weight"):
        SharedInput(_fp8_members(gen, rows=(200, 128, 128)))
