"""YaRN (`model.rope_scaling`) on trainer=megatron: MLA's `rope_type="yarn"` fields from the model config,
and a world-size-1 Megatron model scoring like the native trainer (transformers' DeepseekV3) on the
same checkpoint, at positions well past the YaRN's original length."""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed (dev extra, Python < 3.12)")

from dist_helpers import init_parallel, run_ranks  # noqa: E402
from mapping_helpers import TRAINER, deepseek_cfg, random_hf  # noqa: E402

from skyq.config.enums import RopeScaling  # noqa: E402
from skyq.config.schema import ParallelConfig, PrecisionConfig, RopeScalingConfig  # noqa: E402
from skyq.trainer.megatron.config import config_kwargs, transformer_config  # noqa: E402
from skyq.trainer.native.model import build_model, load_model, write_hf_checkpoint  # noqa: E402

YARN = RopeScalingConfig(
    type=RopeScaling.yarn,
    factor=8.0,
    original_max_position_embeddings=8,
    beta_fast=4.0,
    beta_slow=1.0,
    mscale=1.0,
    mscale_all_dim=0.5,  # != mscale: cos/sin and the softmax are both scaled
)
LOGP_TOL = 2e-5
"""Max |megatron - native| token log-prob, same fp32 weights (tests/megatron/test_worker.py's)."""
TOKENS = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(0))


def yarn_cfg(scaling: RopeScalingConfig = YARN):
    # max_position_embeddings = factor * original length, as transformers expects of a YaRN config
    return deepseek_cfg(
        rope_scaling=scaling, rope_theta=10000.0, num_key_value_heads=4, max_position_embeddings=64
    )


def test_yarn_maps_to_mla_rope_type_yarn_fields():
    name, kw = config_kwargs(yarn_cfg(), PrecisionConfig(), TRAINER, ParallelConfig(), device="cpu")
    assert name == "MLATransformerConfig"
    assert (kw["rope_type"], kw["rotary_base"], kw["rotary_scaling_factor"]) == ("yarn", 10000.0, 8.0)
    assert (kw["original_max_position_embeddings"], kw["beta_fast"], kw["beta_slow"]) == (8, 4.0, 1.0)
    assert (kw["mscale"], kw["mscale_all_dim"]) == (1.0, 0.5)
    c = transformer_config(yarn_cfg(), PrecisionConfig(), TRAINER, ParallelConfig(), device="cpu")
    assert (c.rope_type, c.rotary_scaling_factor, c.mscale_all_dim) == ("yarn", 8.0, 0.5)
    plain = config_kwargs(
        yarn_cfg(RopeScalingConfig()), PrecisionConfig(), TRAINER, ParallelConfig(), device="cpu"
    )
    assert plain[1]["rope_type"] == "rope" and "rotary_scaling_factor" not in plain[1]


def megatron_logprobs(rank: int, hf_dir: str, model_cfg) -> torch.Tensor:
    """World size 1 (gloo): skyq's Megatron model (local spec, fp32) loaded from `hf_dir`."""
    from skyq.trainer.megatron.mapping import load_hf_checkpoint
    from skyq.trainer.megatron.model import build_model as build_megatron

    init_parallel(1, 1)
    model = build_megatron(model_cfg, PrecisionConfig(), TRAINER, ParallelConfig(), device="cpu", seed=0)
    load_hf_checkpoint(model, hf_dir, model_cfg, "local")
    model.eval()
    with torch.no_grad():
        logits = model(TOKENS, torch.arange(TOKENS.shape[1]).expand_as(TOKENS), None)
    return torch.log_softmax(logits.float(), dim=-1)


def test_world_size_one_yarn_log_probs_equal_the_native_trainers(tmp_path):
    model_cfg = yarn_cfg()
    # weights of std 0.5: attention sharp enough that the rotary frequencies show in the log-probs
    tensors = {name: t * 0.5 for name, t in random_hf(model_cfg, seed=0).items()}
    hf_dir = write_hf_checkpoint(tmp_path / "hf", tensors, model_cfg)
    native = load_model(hf_dir, model_cfg).eval()
    plain = build_model(dataclasses.replace(model_cfg, rope_scaling=RopeScalingConfig()), seed=0).eval()
    plain.load_state_dict(native.state_dict())
    with torch.no_grad():
        want = torch.log_softmax(native(input_ids=TOKENS).logits.float(), dim=-1)
        unscaled = torch.log_softmax(plain(input_ids=TOKENS).logits.float(), dim=-1)
    assert float((unscaled - want).abs().max()) > 100 * LOGP_TOL  # YaRN changes the function
    (got,) = run_ranks(megatron_logprobs, 1, str(hf_dir), model_cfg)
    assert float((got - want).abs().max()) < LOGP_TOL
