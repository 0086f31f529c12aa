"""HF <-> Megatron-core name tables, conversions, TP/EP slicing, load and export (trainer=megatron).

skyq's Megatron models (megatron-core 0.16.1 GPTModels, local spec, `build_model`) are built on the
CPU in spawned gloo processes: their tensor names, shapes and partition marks are the ground truth
for the local tables; the Transformer Engine names are golden lists read from megatron-core's
`gpt_layer_specs.py` and `extensions/transformer_engine.py` (TE is not installed here).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed (dev extra, Python < 3.12)")

from dist_helpers import run_ranks  # noqa: E402  (tests/megatron is on sys.path: no __init__.py)
from mapping_helpers import (  # noqa: E402
    deepseek_cfg,
    qwen_cfg,
    random_hf,
    world_size_one,
    world_size_two,
    write_checkpoint,
)

from skyq.trainer.megatron.mapping import (  # noqa: E402
    MappingError,
    global_name,
    hf_to_megatron,
    load_hf_checkpoint,
    local_name,
    megatron_names,
    megatron_to_hf,
    partition,
    shard,
    unshard,
)
from skyq.trainer.megatron.mapping.convert import megatron_shape, parse  # noqa: E402

CONFIGS = {
    "qwen": qwen_cfg(),
    "qwen_kimi_prefix": qwen_cfg(text_prefix="language_model."),
    "qwen_tied": qwen_cfg(tie_word_embeddings=True),
    "deepseek_q_lora": deepseek_cfg(),
    "deepseek_no_q_lora": deepseek_cfg(q_lora_rank=None),
    "deepseek_kimi_prefix": deepseek_cfg(text_prefix="language_model.", num_shared_experts=0),
}


def _round_trip(model_cfg, spec):
    hf = random_hf(model_cfg, seed=3)
    megatron = hf_to_megatron(hf, model_cfg, spec)
    back = {}
    for name, tensor in megatron.items():
        for hf_name, t in megatron_to_hf(name, tensor, model_cfg):
            assert hf_name not in back, f"{hf_name} produced twice"
            back[hf_name] = t
    return hf, megatron, back


@pytest.mark.parametrize("spec", ["local", "te"])
@pytest.mark.parametrize("label", list(CONFIGS))
def test_hf_to_megatron_to_hf_is_the_identity(label, spec):
    model_cfg = CONFIGS[label]
    hf, megatron, back = _round_trip(model_cfg, spec)
    assert set(megatron) == set(megatron_names(model_cfg, spec))
    assert set(back) == set(hf)
    for name, tensor in hf.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name


def test_qkv_is_interleaved_per_query_group():
    # 4 heads in 2 groups, head_dim 8: rows [q0 q1 k0 v0 | q2 q3 k1 v1], each head's rows filled
    # with its own value, so any other stacking (q;k;v) puts the wrong value in some row.
    model_cfg = qwen_cfg()
    d, h = model_cfg.head_dim, model_cfg.hidden_size
    q = torch.arange(4).repeat_interleave(d).float()[:, None].expand(4 * d, h)
    k = (10 + torch.arange(2)).repeat_interleave(d).float()[:, None].expand(2 * d, h)
    v = (20 + torch.arange(2)).repeat_interleave(d).float()[:, None].expand(2 * d, h)
    hf = random_hf(model_cfg, seed=0)
    for name, t in (("q", q), ("k", k), ("v", v)):
        hf[f"model.layers.0.self_attn.{name}_proj.weight"] = t
    qkv = hf_to_megatron(hf, model_cfg, "local")["decoder.layers.0.self_attention.linear_qkv.weight"]
    heads_in_order = qkv[::d, 0].tolist()
    assert heads_in_order == [0, 1, 10, 20, 2, 3, 11, 21]


MODEL_CASES = ["qwen", "qwen_tied", "deepseek_q_lora", "deepseek_no_q_lora"]


@pytest.fixture(scope="module")
def ws1(tmp_path_factory):
    """World size 1 (one spawned process): the models' tensors, and load_hf_checkpoint's errors."""
    tmp = tmp_path_factory.mktemp("ws1")
    hf = random_hf(qwen_cfg(), seed=5)
    missing = dict(hf)
    del missing["model.layers.1.self_attn.k_norm.weight"]
    dirs = {
        "missing": str(write_checkpoint(tmp / "missing", missing)),
        "unused": str(write_checkpoint(tmp / "unused", hf)),
    }
    (result,) = run_ranks(world_size_one, 1, [(label, CONFIGS[label]) for label in MODEL_CASES], dirs)
    return result


def test_local_names_shapes_and_partitions_match_skyq_megatron_models(ws1):
    for label in MODEL_CASES:
        model_cfg, real = CONFIGS[label], ws1["described"][label]
        assert sorted(real) == sorted(megatron_names(model_cfg, "local")), label
        for name, (shape, partition_dim) in real.items():
            assert tuple(shape) == megatron_shape(parse(name, model_cfg), model_cfg), (label, name)
            assert partition(name, model_cfg).dim == partition_dim, (label, name)


def test_load_names_a_parameter_left_unfilled_and_a_checkpoint_tensor_left_unused(ws1):
    errors = ws1["errors"]
    assert "no tensor 'model.layers.1.self_attn.k_norm.weight', needed for model tensor " in errors["missing"]
    assert "decoder.layers.1.self_attention.k_layernorm.weight" in errors["missing"]
    # a model built with tied embeddings has no output_layer for the checkpoint's lm_head
    assert "tensor 'lm_head.weight' (and 0 more) has no tensor to go to" in errors["unused"]
    assert "unused/model-0000" in errors["unused"]
    assert errors["missing_changed"] == errors["unused_changed"] == ""  # refused before any write


def test_load_then_export_gives_back_the_checkpoint_at_world_size_2(tmp_path):
    # TP1 (DP2) first: the reference logits of that checkpoint's TP2 (ETP2; MLA with SP) and EP2
    layouts = [("qwen", 1, 1), ("qwen", 2, 1), ("qwen", 1, 2), ("qwen_kimi_prefix", 1, 2)]
    layouts += [("deepseek_q_lora", 1, 1), ("deepseek_q_lora", 2, 1), ("deepseek_q_lora", 1, 2)]
    layouts += [("deepseek_no_q_lora", 2, 1), ("deepseek_kimi_prefix", 1, 2)]
    dirs = {
        label: str(write_checkpoint(tmp_path / label, random_hf(CONFIGS[label], seed=10 + i)))
        for i, label in enumerate(dict.fromkeys(label for label, _, _ in layouts))
    }
    cases = [(CONFIGS[label], tp, ep, dirs[label]) for label, tp, ep in layouts]
    run_ranks(world_size_two, 2, cases)


def test_te_names_are_the_golden_lists():
    expert_names = [
        f"mlp.experts.linear_fc{i}.weight{e}" for e in range(4) for i in (1, 2)
    ]  # TEGroupedLinear: weight0..weight{E-1}
    qwen_layer = [
        "self_attention.linear_qkv.layer_norm_weight", "self_attention.linear_qkv.weight",
        "self_attention.linear_proj.weight", "self_attention.q_layernorm.weight",
        "self_attention.k_layernorm.weight", "pre_mlp_layernorm.weight", "mlp.router.weight",
    ] + expert_names  # fmt: skip
    qwen = ["embedding.word_embeddings.weight"]
    qwen += [f"decoder.layers.{i}.{n}" for i in range(2) for n in qwen_layer]
    qwen += ["decoder.final_layernorm.weight", "output_layer.weight"]
    assert sorted(megatron_names(qwen_cfg(), "te")) == sorted(qwen)

    mla = [
        "input_layernorm.weight", "self_attention.linear_q_down_proj.weight",
        "self_attention.linear_q_up_proj.layer_norm_weight", "self_attention.linear_q_up_proj.weight",
        "self_attention.linear_kv_down_proj.weight", "self_attention.linear_kv_up_proj.layer_norm_weight",
        "self_attention.linear_kv_up_proj.weight", "self_attention.linear_proj.weight",
    ]  # fmt: skip
    dense = ["mlp.linear_fc1.layer_norm_weight", "mlp.linear_fc1.weight", "mlp.linear_fc2.weight"]
    moe = [
        "pre_mlp_layernorm.weight", "mlp.router.weight", "mlp.router.expert_bias",
        "mlp.shared_experts.linear_fc1.weight", "mlp.shared_experts.linear_fc2.weight",
    ] + expert_names  # fmt: skip
    deepseek = ["embedding.word_embeddings.weight"]
    deepseek += [f"decoder.layers.0.{n}" for n in mla + dense]
    deepseek += [f"decoder.layers.1.{n}" for n in mla + moe]
    deepseek += ["decoder.final_layernorm.weight", "output_layer.weight"]
    assert sorted(megatron_names(deepseek_cfg(), "te")) == sorted(deepseek)


def test_shard_and_unshard_follow_megatron_partitions():
    model_cfg = deepseek_cfg()
    full = hf_to_megatron(random_hf(model_cfg, seed=1), model_cfg, "local")
    fc1 = "decoder.layers.0.mlp.linear_fc1.weight"  # [gate; up], 48 rows each
    piece = shard(fc1, full[fc1], model_cfg, tp_rank=1, tp_size=2, ep_rank=0, ep_size=1)
    gate, up = full[fc1].chunk(2)
    assert torch.equal(piece, torch.cat([gate[24:], up[24:]]))
    for name, tensor in full.items():
        pieces = [
            shard(name, tensor, model_cfg, tp_rank=r, tp_size=2, ep_rank=0, ep_size=1, etp_rank=r, etp_size=2)
            for r in range(2)
        ]
        assert torch.equal(unshard(name, pieces, model_cfg), tensor), name
    proj = "decoder.layers.1.self_attention.linear_proj.weight"
    assert shard(proj, full[proj], model_cfg, tp_rank=0, tp_size=2, ep_rank=0, ep_size=1).shape == (32, 16)
    down = "decoder.layers.1.self_attention.linear_kv_down_proj.weight"
    assert shard(down, full[down], model_cfg, tp_rank=1, tp_size=2, ep_rank=0, ep_size=1) is full[down]
    expert3 = "decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.weight"
    assert shard(expert3, full[expert3], model_cfg, tp_rank=0, tp_size=1, ep_rank=0, ep_size=2) is None
    assert (
        shard(expert3, full[expert3], model_cfg, tp_rank=0, tp_size=1, ep_rank=1, ep_size=2) is full[expert3]
    )
    assert (
        local_name(expert3, model_cfg, 1, 2)
        == "decoder.layers.1.mlp.experts.local_experts.1.linear_fc2.weight"
    )
    assert local_name(expert3, model_cfg, 0, 2) is None
    assert global_name("module.decoder.layers.1.mlp.experts.linear_fc1.weight1", model_cfg, 1, 2) == (
        "decoder.layers.1.mlp.experts.linear_fc1.weight3"
    )


def test_a_checkpoint_tensor_without_a_place_is_refused_naming_it_and_its_file(tmp_path):
    model_cfg = qwen_cfg()
    hf = random_hf(model_cfg, seed=2)
    hf["model.layers.0.mlp.experts.7.up_proj.weight"] = torch.zeros(16, 32, dtype=torch.bfloat16)
    hf_dir = write_checkpoint(tmp_path / "bad", hf, shards=1)
    with pytest.raises(
        MappingError,
        match=r"model\.layers\.0\.mlp\.experts\.7\.up_proj\.weight \(in .*bad/model-00001-of-00001\.safetensors\)",
    ):
        load_hf_checkpoint(torch.nn.Linear(1, 1), hf_dir, model_cfg, "local")

    hf = random_hf(model_cfg, seed=2)
    hf["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(8, 32, dtype=torch.bfloat16)
    hf_dir = write_checkpoint(tmp_path / "shape", hf, shards=1)
    with pytest.raises(
        MappingError,
        match=r"k_proj\.weight \(in .*shape/.*\): shape \(8, 32\), the model config needs \(16, 32\)",
    ):
        load_hf_checkpoint(torch.nn.Linear(1, 1), hf_dir, model_cfg, "local")


def test_hf_to_megatron_names_what_it_cannot_fill_or_place():
    model_cfg = deepseek_cfg()
    hf = random_hf(model_cfg, seed=4)
    del hf["model.layers.1.mlp.shared_experts.up_proj.weight"]
    with pytest.raises(
        MappingError,
        match=r"decoder\.layers\.1\.mlp\.shared_experts\.linear_fc1\.weight \(needs model\.layers\.1\.mlp\.shared_experts\.up_proj\.weight\)",
    ):
        hf_to_megatron(hf, model_cfg, "te")
    hf = random_hf(model_cfg, seed=4)
    hf["model.layers.0.mlp.gate.weight"] = torch.zeros(4, 32)  # layer 0 is dense: no router
    with pytest.raises(MappingError, match=r"model\.layers\.0\.mlp\.gate\.weight: not a tensor"):
        hf_to_megatron(hf, model_cfg, "local")


def test_megatron_to_hf_refuses_a_shard_or_an_unknown_name():
    model_cfg = qwen_cfg()
    with pytest.raises(
        MappingError, match=r"linear_qkv\.weight: shape \(32, 32\), the model config needs \(64, 32\)"
    ):
        megatron_to_hf("decoder.layers.0.self_attention.linear_qkv.weight", torch.zeros(32, 32), model_cfg)
    with pytest.raises(
        MappingError,
        match=r"decoder\.layers\.0\.mlp\.shared_experts\.linear_fc1\.weight: not a Megatron tensor",
    ):
        megatron_to_hf(
            "decoder.layers.0.mlp.shared_experts.linear_fc1.weight", torch.zeros(32, 32), model_cfg
        )
    with pytest.raises(MappingError, match="expert 4 is outside model.num_experts=4"):
        megatron_to_hf("decoder.layers.0.mlp.experts.linear_fc2.weight4", torch.zeros(32, 16), model_cfg)
    with pytest.raises(MappingError, match="num_nextn_predict_layers=1"):
        megatron_names(deepseek_cfg(num_nextn_predict_layers=1), "local")
