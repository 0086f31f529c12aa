"""The trainer computes on exactly the weights the engine dequantizes from the wire."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from native_fixtures import PRECISIONS

from skyq.quant import fp8_blockwise, mxfp8
from skyq.quant.layouts import Role
from skyq.trainer.native.precision import (
    ActivationQuantExperts,
    ActivationQuantLinear,
    RoutedExperts,
    _QuantizedExperts,
    route_experts,
)
from skyq.trainer.native.trainer import token_logprobs


def _served_weights(trainer) -> dict[str, torch.Tensor]:
    """HF name -> what an engine computes with: deserialize(serialize(hf_weights()))."""
    strategy, layout, model_cfg = trainer.strategy, trainer.layout, trainer.model_cfg
    served = {}
    for name, tensor in trainer.hf_weights():
        role = layout.role(name, model_cfg)
        served[name] = strategy.deserialize(name, strategy.serialize(name, tensor, role=role), role=role)
    return served


@pytest.mark.parametrize("precision", PRECISIONS)
def test_effective_weights_equal_served_weights_bitwise(make_trainer, precision):
    trainer = make_trainer(precision)
    with torch.no_grad():
        effective = {k: v.to(torch.bfloat16) for k, v in trainer.effective_parameters().items()}
    effective_hf = trainer.layout.split_experts(effective, trainer.model_cfg)
    served = _served_weights(trainer)
    assert set(effective_hf) == set(served)
    for name, value in served.items():
        assert value.dtype == torch.bfloat16
        assert torch.equal(effective_hf[name].view(torch.int16), value.view(torch.int16)), name


@pytest.mark.parametrize("precision", PRECISIONS)
def test_quantization_scope_follows_the_strategy(make_trainer, precision):
    trainer = make_trainer(precision)
    with torch.no_grad():
        effective = trainer.effective_parameters()
        for name, master in trainer.model.named_parameters():
            role = trainer.layout.role(name, trainer.model_cfg)
            unchanged = torch.equal(effective[name], master.to(torch.bfloat16).float())
            assert unchanged == (not trainer.strategy.quantizes(role) or master.ndim < 2), name
    expected_roles = {
        "bf16": set(),
        "fp8_blockwise": {Role.attention, Role.routed_expert},
        "mxfp8": {Role.routed_expert},
        "int4_qat": {Role.routed_expert},
    }[precision]
    model_roles = {trainer.layout.role(n, trainer.model_cfg) for n, _ in trainer.model.named_parameters()}
    assert {r for r in model_roles if trainer.strategy.quantizes(r)} == expected_roles
    rewritten = {trainer.layout.role(f"{m}.weight" if "experts" not in m else f"{m}.down_proj", trainer.model_cfg)
                 for m in trainer.activation_quantized}  # fmt: skip
    # activations are quantized only by the FP8 recipes, and only on the linears they quantize
    assert rewritten == (expected_roles if precision in ("fp8_blockwise", "mxfp8") else set())


def _act_reference(precision: str, x: torch.Tensor) -> torch.Tensor:
    """What the engine's W8A8 GEMM multiplies: its bf16 activation quantized, dequantized in x's dtype."""
    x = x.to(torch.bfloat16).to(x.dtype)
    if precision == "fp8_blockwise":
        return fp8_blockwise.dequantize_activation(*fp8_blockwise.quantize_activation(x), dtype=x.dtype)
    return mxfp8.dequantize(*mxfp8.quantize(x), dtype=x.dtype)


@pytest.mark.parametrize("precision", ["fp8_blockwise", "mxfp8"])
def test_fp8_linears_compute_on_quantized_activations_and_served_weights(make_trainer, precision):
    trainer = make_trainer(precision)
    served = _served_weights(trainer)
    captured: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    hooks = [
        module.register_forward_hook(
            lambda mod, args, out, name=name: captured.__setitem__(name, (args, out))
        )
        for name, module in trainer.model.named_modules()
        if isinstance(module, ActivationQuantLinear | ActivationQuantExperts)
    ]
    ids = torch.tensor([[1, 5, 13, 7, 18, 3], [1, 9, 13, 9, 18, 4]])
    trainer.logprobs(ids, torch.ones_like(ids))
    for hook in hooks:
        hook.remove()
    assert captured
    for name, (args, out) in captured.items():
        if name.endswith("experts"):
            hidden, top_k_index, top_k_weights = args
            expected = torch.zeros_like(hidden)
            for t in range(hidden.shape[0]):
                for k in range(top_k_index.shape[1]):
                    e = int(top_k_index[t, k])
                    w = {
                        p: served[f"{name}.{e}.{p}.weight"].float()
                        for p in ("gate_proj", "up_proj", "down_proj")
                    }
                    x = _act_reference(precision, hidden[t : t + 1])
                    h = F.silu(F.linear(x, w["gate_proj"])) * F.linear(x, w["up_proj"])
                    expected[t] += (
                        F.linear(_act_reference(precision, h), w["down_proj"]) * top_k_weights[t, k]
                    )[0]
            torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
        else:
            (x,) = args
            expected = F.linear(_act_reference(precision, x), served[f"{name}.weight"].float())
            torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_straight_through_gradients_reach_every_master_weight(make_trainer, precision):
    trainer = make_trainer(precision)
    ids = torch.tensor([[1, 5, 13, 7, 18, 3]])
    logp = token_logprobs(trainer._forward(trainer.effective_parameters()), ids, torch.ones_like(ids))
    logp.sum().backward()
    for name, param in trainer.model.named_parameters():
        assert param.grad is not None and bool(param.grad.abs().sum() > 0), name


@pytest.mark.parametrize("precision", ["fp8_blockwise", "mxfp8"])
def test_activation_codes_come_from_the_bf16_activation(make_trainer, precision):
    """fp32 inputs that round to the engine's bf16 activation get the engine's codes and scales,
    exact e4m3 ties included (8.5 with a 1/16 power-of-two scale is halfway between codes 128 and
    144 and rounds to even, as in the engine); the fp32 neighbours used to break such ties at random
    and, through the tile max, shift every fp32 scale."""
    trainer = make_trainer(precision)
    module = next(
        m for m in trainer.model.modules() if isinstance(m, ActivationQuantLinear | ActivationQuantExperts)
    )
    if isinstance(module, ActivationQuantLinear):
        weight, project = module.weight, module
    else:
        weight = module.gate_up_proj[0]
        project = lambda x: module._linear(x, weight)  # noqa: E731
    engine_x = torch.randn(64, weight.shape[1], generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    engine_x[:, 0::32] = 16.0  # the max of every 32- and 128-tile
    engine_x[:, 1::32] = 8.5
    below = torch.nextafter(engine_x.float(), torch.zeros(()))  # fp32 values that round to engine_x
    above = torch.nextafter(engine_x.float(), torch.full((), 100.0))
    with torch.no_grad():
        reference = F.linear(_act_reference(precision, engine_x.float()), weight.float())
        for x in (below, above):
            torch.testing.assert_close(project(x), reference, rtol=0, atol=0)


@pytest.mark.parametrize("precision", ["fp8_blockwise", "mxfp8", "bf16"])
def test_grouped_experts_forward_is_the_loop_in_value_and_gradient(make_trainer, precision):
    """The trainer's grouped experts (`grouped_forward`: the GPU's path, two grouped GEMMs over the
    rows sorted by expert) against the per-expert loop on the same bf16 inputs and weights (CPU
    `torch._grouped_mm` here): equal bit for bit in the output and in the gradients of the input, the
    router weights and both expert stacks (on the H200, tests/launch/test_local_pair_gpu.py checks the
    trainer's log-probs against the engine's bit for bit). FP8 / MXFP8: `ActivationQuantExperts`;
    bf16: `RoutedExperts`, which a GPU trainer puts in place of transformers' experts
    (`route_experts`; on this CPU trainer done here by hand). An expert past the layer is refused."""
    trainer = make_trainer(precision)
    if precision == "bf16":
        assert trainer.routed_experts == []  # a CPU trainer keeps transformers' experts
        assert route_experts(trainer.model)
    module = next(
        m for m in trainer.model.modules() if isinstance(m, (ActivationQuantExperts, RoutedExperts))
    )
    gen = torch.Generator().manual_seed(4)
    tokens, k, experts = 29, module_top_k(trainer), module.num_experts
    hidden_size = module.gate_up_proj.shape[-1]
    index = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(tokens)])
    results = []
    for grouped in (True, False):
        hidden = torch.randn(tokens, hidden_size, generator=torch.Generator().manual_seed(5)).to(
            torch.bfloat16
        )
        weights = torch.softmax(torch.randn(tokens, k, generator=torch.Generator().manual_seed(6)), -1)
        hidden, weights = hidden.requires_grad_(), weights.to(torch.bfloat16).requires_grad_()
        gu = torch.nn.Parameter(module.gate_up_proj.detach().to(torch.bfloat16))
        dn = torch.nn.Parameter(module.down_proj.detach().to(torch.bfloat16))
        module.gate_up_proj, module.down_proj = gu, dn
        loop = functools.partial(_QuantizedExperts.forward, module)  # the per-expert loop
        fn = module.grouped_forward if grouped else loop
        out = fn(hidden, index, weights)
        out.float().square().sum().backward()
        results.append(
            [
                out.detach().float(),
                hidden.grad.float(),
                weights.grad.float(),
                gu.grad.float(),
                dn.grad.float(),
            ]
        )
    for got, want in zip(*results, strict=True):
        assert torch.equal(got, want)
    with pytest.raises(ValueError, match=f"router chose expert {experts} of a layer with {experts} experts"):
        module.grouped_forward(hidden, torch.full_like(index, experts), weights)


def test_route_experts_takes_transformers_experts_only_and_keeps_their_parameters(make_trainer):
    """`route_experts` puts a `RoutedExperts` in place of every fused experts module still
    transformers' own, each holding the very same parameters under the same names (the optimizer,
    the layout and the sync see no change); on the CPU it computes what transformers' module computes,
    and it leaves the FP8 trainer's activation-quantized experts alone."""
    trainer = make_trainer("bf16")
    stock = {n: m for n, m in trainer.model.named_modules() if type(m).__name__.endswith("Experts")}
    params = dict(trainer.model.named_parameters())
    assert stock and route_experts(trainer.model) == list(stock)
    after = dict(trainer.model.named_parameters())
    assert list(after) == list(params) and all(after[n] is params[n] for n in params)
    gen = torch.Generator().manual_seed(7)
    for name, old in stock.items():
        new = trainer.model.get_submodule(name)
        assert isinstance(new, RoutedExperts) and new.gate_up_proj is old.gate_up_proj
        hidden = torch.randn(13, old.gate_up_proj.shape[-1], generator=gen)
        index = torch.stack([torch.randperm(old.num_experts, generator=gen)[:2] for _ in range(13)])
        weights = torch.softmax(torch.randn(13, 2, generator=gen), -1)
        with torch.no_grad():
            torch.testing.assert_close(new(hidden, index, weights), old(hidden, index, weights))
    assert route_experts(trainer.model) == []  # nothing left to take
    fp8 = make_trainer("fp8_blockwise")
    assert route_experts(fp8.model) == []
    assert any(isinstance(m, ActivationQuantExperts) for m in fp8.model.modules())


def module_top_k(trainer) -> int:
    return trainer.model.config.num_experts_per_tok
