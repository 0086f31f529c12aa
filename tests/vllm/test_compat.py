"""compat's version shims agree with the installed vLLM where it has the original."""

from __future__ import annotations

import math
import random
import types

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


def _wna16_moe_layout_026(experts: int, hidden: int, inter: int, group: int) -> dict[str, tuple[int, ...]]:
    """A fake of ONLY the parameter layout (name -> shape) that vLLM 0.26's
    `CompressedTensorsWNA16MarlinMoEMethod.create_weights` gives a routed-experts layer for symmetric INT4
    groups (Marlin's transposed [E, K, N] orientation): packed weights, group scales, one `weight_shape`
    row per expert for w13 and w2, and the act-order tensors it creates whether or not the checkpoint
    has act order."""
    e, h, i = experts, hidden, inter
    return {
        "w13_weight_packed": (e, h // 8, 2 * i),
        "w2_weight_packed": (e, i // 8, h),
        "w13_weight_scale": (e, h // group, 2 * i),
        "w2_weight_scale": (e, i // group, h),
        "w2_weight_shape": (e, 2),
        "w13_weight_shape": (e, 2),
        "w13_weight_g_idx": (e, h),
        "w2_weight_g_idx": (e, i),
        "w13_g_idx_sort_indices": (e, h),
        "w2_g_idx_sort_indices": (e, i),
    }


def test_checkpoint_copies_balance_vllm_026_w4a16_moe_with_the_wire():
    """The routed experts' wire tensors of one layer (skyq's INT4 plan) hold exactly the elements vLLM
    0.26's W4A16 MoE layer counts on a reload, once its act-order tensors (filled by no checkpoint without
    act order) count 0 and its w13 `weight_shape` row (written by gate and up) twice; counted plainly,
    they do not balance (the H200 run's refusal at init)."""
    model = ModelConfig(hidden_size=256, moe_intermediate_size=192, num_experts=8)
    precision = PrecisionConfig(name=Precision.int4_qat, int4_group_size=32)
    wire = sum(
        math.prod(w.shape)
        for p in build_plan(model, precision)
        if ".layers.0.mlp.experts." in p.name
        for w in p.wire
    )
    layout = _wna16_moe_layout_026(8, 256, 192, 32)
    for method in sorted(compat.WNA16_MOE_METHODS):
        counted = sum(
            math.prod(shape) * compat.load_copies(name, method=method, actorder=None, fused_shards=1)
            for name, shape in layout.items()
        )
        assert counted == wire
    assert sum(math.prod(shape) for shape in layout.values()) != wire
    # a checkpoint with act order fills them: they count (and skyq's plan, which has none, is refused)
    assert compat.load_copies("w13_weight_g_idx", method="CompressedTensorsWNA16MarlinMoEMethod",
                              actorder="group", fused_shards=1) == 1  # fmt: skip
    # other methods' tensors of the same names count once
    assert compat.load_copies("w13_weight_shape", method="Fp8MoEMethod", actorder=None, fused_shards=1) == 1


def test_checkpoint_copies_reads_the_layer():
    """`checkpoint_copies` takes the method (or a linear's scheme), act order and fused members from the layer."""

    class CompressedTensorsWNA16MarlinMoEMethod:
        weight_quant = types.SimpleNamespace(actorder=None)

    class CompressedTensorsWNA16:
        pass

    experts = types.SimpleNamespace(quant_method=CompressedTensorsWNA16MarlinMoEMethod())
    assert compat.checkpoint_copies(experts, "w2_g_idx_sort_indices") == 0
    assert compat.checkpoint_copies(experts, "w13_weight_shape") == 2
    qkv = types.SimpleNamespace(
        quant_method=object(), scheme=CompressedTensorsWNA16(), output_sizes=[64, 32, 32]
    )
    assert compat.checkpoint_copies(qkv, "weight_shape") == 3
    assert compat.checkpoint_copies(qkv, "weight_packed") == 1
    o_proj = types.SimpleNamespace(quant_method=object(), scheme=CompressedTensorsWNA16())
    assert compat.checkpoint_copies(o_proj, "weight_shape") == 1
