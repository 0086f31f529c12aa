"""Plan dtypes by name (the plan is built without torch): each name is its torch dtype's `str()` with
its size, and the layouts' specs, the wire specs and the plan entries give code that makes tensors
the torch dtype their name says."""

from __future__ import annotations

import math

import pytest
import torch

from skyq.config.enums import ModelFamily, Precision
from skyq.config.schema import ModelConfig, PrecisionConfig
from skyq.quant import dtype_names, int4
from skyq.quant.layouts import Role, get_layout
from skyq.quant.plan import build_plan
from skyq.quant.strategies import get_strategy, int4_qat

QWEN_TINY = ModelConfig(
    family=ModelFamily.qwen3_moe, vocab_size=48, hidden_size=64, num_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
)  # fmt: skip
DSV3_TINY = ModelConfig(
    family=ModelFamily.deepseek_v3, vocab_size=48, hidden_size=64, num_layers=3, num_attention_heads=4,
    num_key_value_heads=4, intermediate_size=96, moe_intermediate_size=32, num_experts=4,
    num_experts_per_tok=2, num_shared_experts=1, first_k_dense_replace=1, q_lora_rank=24, kv_lora_rank=16,
    qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, num_nextn_predict_layers=1,
)  # fmt: skip


def test_every_plan_dtype_name_is_str_of_its_torch_dtype_with_its_size():
    for name, size in dtype_names.ITEMSIZE.items():
        dtype = dtype_names.torch_dtype(name)
        assert isinstance(dtype, torch.dtype) and str(dtype) == name and dtype.itemsize == size


def test_a_dtype_name_outside_the_plan_table_is_refused_naming_it():
    with pytest.raises(ValueError, match="'torch.float64' is not a plan dtype"):
        dtype_names.torch_dtype("torch.float64")


def test_int4_wire_specs_pack_as_many_codes_per_word_as_the_quantizer():
    assert int4_qat.CODES_PER_WORD == int4.CODES_PER_WORD


@pytest.mark.parametrize("precision", list(Precision))
@pytest.mark.parametrize("model_cfg", [QWEN_TINY, DSV3_TINY], ids=["qwen3_moe", "deepseek_v3"])
def test_specs_and_plan_entries_give_the_torch_dtypes_serialize_produces(precision, model_cfg):
    """Every checkpoint tensor's `.dtype` (fp32 router bias, MTP's too, else bf16), the same on its plan entry;
    every wire spec's `.dtype` and `nbytes` those of the tensor `serialize` makes of random data."""
    precision_cfg = PrecisionConfig(name=precision, int4_group_size=32)
    strategy, plan = get_strategy(precision_cfg), build_plan(model_cfg, precision_cfg)
    g = torch.Generator().manual_seed(0)
    for spec in get_layout(model_cfg.family).hf_parameters(model_cfg):
        want = torch.float32 if spec.name.endswith("e_score_correction_bias") else torch.bfloat16
        entry = plan[spec.name]
        assert spec.dtype is want and entry.dtype is want, spec
        assert entry.bf16_bytes == math.prod(spec.shape) * want.itemsize
        wire = strategy.serialize(spec.name, torch.randn(spec.shape, generator=g).to(want), role=spec.role)
        assert [(w.name, w.shape, w.dtype) for w in entry.wire] == [
            (n, tuple(t.shape), t.dtype) for n, t in wire.items()
        ]
        assert entry.bytes == sum(w.nbytes for w in entry.wire) == sum(t.nbytes for t in wire.values())


@pytest.mark.parametrize("precision", [Precision.fp8_blockwise, Precision.mxfp8, Precision.int4_qat])
def test_deserialize_without_a_dtype_returns_bf16(precision):
    strategy = get_strategy(PrecisionConfig(name=precision, int4_group_size=32))
    w = torch.randn(64, 64, generator=torch.Generator().manual_seed(1), dtype=torch.float32)
    wire = strategy.serialize("m.experts.0.up_proj.weight", w, role=Role.routed_expert)
    out = strategy.deserialize("m.experts.0.up_proj.weight", wire, role=Role.routed_expert)
    assert out.dtype is torch.bfloat16
    as_fp32 = strategy.deserialize(
        "m.experts.0.up_proj.weight", wire, role=Role.routed_expert, dtype=torch.float32
    )
    assert torch.equal(out, as_fp32.bfloat16())
