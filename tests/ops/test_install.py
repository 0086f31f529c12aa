"""`skyq.ops.install`: every model skyq builds (the trainer's `build_model`, the engine's) carries
skyq's norms, routers and rotary function, keeping parameter objects and names, and on the CPU it
computes what the stock transformers model computes, bit for bit."""

from __future__ import annotations

import torch
from transformers import Qwen3MoeForCausalLM
from transformers.models.qwen3_moe import modeling_qwen3_moe as modeling

from skyq import ops
from skyq.checkpoint.hf_config import hf_config
from skyq.config.store import compose, to_object
from skyq.ops import rotary
from skyq.ops.rmsnorm import RMSNorm
from skyq.ops.router import TopKRouter
from skyq.rollout.embedded import EmbeddedEngine
from skyq.trainer.native.model import build_model


def _stock_types(model: torch.nn.Module) -> set[type]:
    return {type(m) for m in model.modules()} & {modeling.Qwen3MoeRMSNorm, modeling.Qwen3MoeTopKRouter}


def test_install_replaces_norms_and_routers_keeping_parameters_and_cpu_outputs():
    cfg = to_object(compose([]))
    model = Qwen3MoeForCausalLM(hf_config(cfg.model))
    stock = Qwen3MoeForCausalLM(hf_config(cfg.model))
    stock.load_state_dict(model.state_dict())
    params_before = dict(model.named_parameters())
    replaced = ops.install(model)
    layers = cfg.model.num_layers
    assert (
        len(replaced) == 5 * layers + 1
    )  # input, post-attention, q, k norms and the router a layer + final norm
    assert sum(isinstance(model.get_submodule(n), TopKRouter) for n in replaced) == layers
    assert all(isinstance(model.get_submodule(n), RMSNorm | TopKRouter) for n in replaced)
    assert not _stock_types(model)
    assert dict(model.named_parameters()) == params_before  # the same objects under the same names
    assert modeling.apply_rotary_pos_emb is rotary.apply_rotary_pos_emb
    ids = torch.randint(0, cfg.model.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, stock(input_ids=ids).logits)


def test_trainer_and_engine_models_carry_skyq_ops():
    cfg = to_object(compose([]))
    for model in (
        build_model(cfg.model, seed=3),
        EmbeddedEngine(model_cfg=cfg.model, precision_cfg=cfg.precision, seed=0).model,
    ):
        assert not _stock_types(model)
        assert sum(isinstance(m, RMSNorm) for m in model.modules()) == 4 * cfg.model.num_layers + 1
        assert sum(isinstance(m, TopKRouter) for m in model.modules()) == cfg.model.num_layers
