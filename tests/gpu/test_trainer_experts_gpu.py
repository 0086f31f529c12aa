"""The trainer's grouped QAT experts on a GPU (`ActivationQuantExperts.grouped_forward`): inside the
trainer's deferred-check scope a forward and backward make no host sync, and a router index past
the layer is still refused, by name, when the scope reads its flags."""

from __future__ import annotations

import pytest
import torch

from skyq.quant.kernels import dispatch
from skyq.trainer.native.precision import ActivationQuantExperts
from tests.trainer.test_precision import module_top_k

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _experts_on_gpu(make_trainer):
    trainer = make_trainer("fp8_blockwise")
    module = next(m for m in trainer.model.modules() if isinstance(m, ActivationQuantExperts))
    module.gate_up_proj = torch.nn.Parameter(module.gate_up_proj.detach().to(torch.bfloat16).cuda())
    module.down_proj = torch.nn.Parameter(module.down_proj.detach().to(torch.bfloat16).cuda())
    gen = torch.Generator().manual_seed(7)
    tokens, k, experts = 40, module_top_k(trainer), module.num_experts
    index = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(tokens)]).cuda()
    hidden = torch.randn(tokens, module.gate_up_proj.shape[-1], generator=gen).to(torch.bfloat16).cuda()
    weights = torch.softmax(torch.randn(tokens, k, generator=gen), -1).to(torch.bfloat16).cuda()
    return module, index, hidden.requires_grad_(), weights.requires_grad_()


def test_grouped_experts_make_no_host_sync_in_a_deferred_scope(make_trainer):
    module, index, hidden, weights = _experts_on_gpu(make_trainer)
    module.grouped_forward(hidden, index, weights).float().sum().backward()  # compiles the kernels
    with dispatch.deferred_finite_checks():
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = module.grouped_forward(hidden, index, weights)
            out.float().square().sum().backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(out.float()).all() and hidden.grad is not None


def test_an_expert_past_the_layer_is_refused_when_the_scope_reads_its_flags(make_trainer):
    module, index, hidden, weights = _experts_on_gpu(make_trainer)
    bad = index.clone()
    bad[3, 1] = module.num_experts
    with pytest.raises(ValueError, match=f"router chose expert {module.num_experts} of a layer with"):
        with dispatch.deferred_finite_checks():
            module.grouped_forward(hidden, bad, weights)
    with pytest.raises(ValueError, match="router chose expert"):  # outside a scope: checked at once
        module.grouped_forward(hidden, bad, weights)
