"""compat's version shims agree with the installed vLLM where it has the original."""

from __future__ import annotations

import random

from vllm.distributed.weight_transfer.base import layerwise_groups

from skyq.config.enums import Precision
from skyq.config.schema import ModelConfig, PrecisionConfig
from skyq.quant.plan import build_plan
from skyq.rollout.vllm import compat
from skyq.rollout.vllm.transfer import SkyqWeightTransferEngine


def test_layer_groups_is_vllms_rule():
    names = [w.name for p in build_plan(ModelConfig(num_layers=3), PrecisionConfig(name=Precision.int4_qat))
             for w in p.wire]  # fmt: skip
    names += ["visual.blocks.1.proj.weight", "visual.blocks.0.proj.weight", "lm_head.weight"]
    for seed in range(5):
        shuffled = random.Random(seed).sample(names, len(names))
        assert compat.layer_groups(shuffled) == layerwise_groups(shuffled)


def test_skyq_transfer_engine_is_concrete():
    """vLLM 0.26 declares `trainer_send_weights` abstract on the worker-side base; skyq defines it."""
    assert not SkyqWeightTransferEngine.__abstractmethods__
    assert "trainer_send_weights" in vars(SkyqWeightTransferEngine)
