"""Round trips, oracles (transformers, compressed-tensors) and idempotence of the converters."""

from __future__ import annotations

import json

import pytest
import torch
from checkpoint.tiny_checkpoints import INDEX, TOKENIZER_FILES, dir_bytes, load_all, reshard, scales_apart

from skyq.checkpoint.int4_convert import matches_ignore_rule
from skyq.checkpoint.reader import ShardedCheckpoint
from skyq.quant import fp8_blockwise, int4
from skyq.tools import convert_fp8_to_bf16, convert_hf_to_fp8, convert_hf_to_int4, convert_moe_int4_to_bf16


def _fp8_error_bound(w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """e4m3 keeps 3 mantissa bits (relative error <= 2^-4), subnormal step 2^-9 * scale_inv, plus
    the final bf16 rounding (2^-8 relative)."""
    s = scale_inv.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[: w.shape[0], : w.shape[1]]
    return w.abs() * (2**-4 + 2**-8) * 1.001 + s * 2**-10


@pytest.mark.parametrize("model", ["qwen", "kimi"])
def test_fp8_block_round_trip_within_e4m3_bound(
    model, qwen_bf16, kimi_bf16, qwen_fp8, kimi_fp8_split, tmp_path
):
    source = qwen_bf16 if model == "qwen" else kimi_bf16
    fp8_dir = qwen_fp8 if model == "qwen" else kimi_fp8_split
    if model == "qwen":  # also make the qwen input put scales apart from weights
        reshard(qwen_fp8, tmp_path / "split", max_shard_bytes=48 * 1024, place=scales_apart)
        fp8_dir = tmp_path / "split"
    ckpt = ShardedCheckpoint(fp8_dir)
    assert any(
        ckpt.tensors[n].shard != ckpt.tensors[n + "_scale_inv"].shard
        for n in ckpt.tensors
        if n + "_scale_inv" in ckpt.tensors
    )
    assert convert_fp8_to_bf16.main(["--model-dir", str(fp8_dir), "--save-dir", str(tmp_path / "bf16")]) == 0
    original, fp8, back = load_all(source), load_all(fp8_dir), load_all(tmp_path / "bf16")
    assert back.keys() == original.keys()
    for name, w in original.items():
        if name + "_scale_inv" not in fp8:
            assert torch.equal(back[name], w), f"{name} must pass through unchanged"
            continue
        err = (back[name].float() - w.float()).abs()
        assert (err <= _fp8_error_bound(w.float(), fp8[name + "_scale_inv"], (128, 128))).all(), name
    quantized = {n for n in fp8 if fp8[n].dtype == torch.float8_e4m3fn}
    assert quantized and all(
        (".mlp.gate.weight" not in n and "lm_head" not in n and "embed" not in n) for n in quantized
    )
    assert not any(n.startswith(("vision_tower", "mm_projector")) for n in quantized)
    assert any("shared_experts" in n for n in quantized) == (model == "kimi")
    config = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert "quantization_config" not in config and "quantization_config" not in config.get("text_config", {})
    index = json.loads((tmp_path / "bf16" / INDEX).read_text())
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in back.values())
    for name in TOKENIZER_FILES:
        assert (tmp_path / "bf16" / name).read_text() == (source / name).read_text()


def test_fp8_config_block_matches_formats(qwen_fp8):
    block = json.loads((qwen_fp8 / "config.json").read_text())["quantization_config"]
    assert block == {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
        "modules_to_not_convert": ["lm_head", "model.layers.0.mlp.gate", "model.layers.1.mlp.gate"],
    }  # fmt: skip
    scales = {n: t for n, t in load_all(qwen_fp8).items() if n.endswith("_scale_inv")}
    assert all(
        t.dtype == torch.float32 and torch.isfinite(t).all() and (t > 0).all() for t in scales.values()
    )


@pytest.mark.parametrize("strategy", ["channel", "tensor"])
def test_channel_and_tensor_strategies_round_trip(strategy, qwen_bf16, tmp_path):
    fp8, bf16 = tmp_path / "fp8", tmp_path / "bf16"
    assert (
        convert_hf_to_fp8.main(
            ["--model-dir", str(qwen_bf16), "--save-dir", str(fp8), "--strategy", strategy]
        )
        == 0
    )
    block = json.loads((fp8 / "config.json").read_text())["quantization_config"]
    assert block["quant_method"] == ("compressed-tensors" if strategy == "channel" else "fp8")
    assert "weight_block_size" not in block
    assert convert_fp8_to_bf16.main(["--model-dir", str(fp8), "--save-dir", str(bf16)]) == 0
    original, q, back = load_all(qwen_bf16), load_all(fp8), load_all(bf16)
    for name, w in original.items():
        if name + "_scale" in q:
            s = q[name + "_scale"]
            assert s.shape == ((w.shape[0], 1) if strategy == "channel" else (1,))
            bound = w.float().abs() * (2**-4 + 2**-8) * 1.001 + s * 2**-10
            assert ((back[name].float() - w.float()).abs() <= bound).all(), name


def test_ue8m0_scales_are_pow2_and_requantizing_the_result_is_a_fixed_point(qwen_bf16, tmp_path):
    args = ["--scale-fmt", "ue8m0"]
    assert (
        convert_hf_to_fp8.main(["--model-dir", str(qwen_bf16), "--save-dir", str(tmp_path / "a"), *args]) == 0
    )
    assert (
        json.loads((tmp_path / "a" / "config.json").read_text())["quantization_config"]["scale_fmt"]
        == "ue8m0"
    )
    assert (
        convert_fp8_to_bf16.main(["--model-dir", str(tmp_path / "a"), "--save-dir", str(tmp_path / "b")]) == 0
    )
    assert (
        convert_hf_to_fp8.main(["--model-dir", str(tmp_path / "b"), "--save-dir", str(tmp_path / "c"), *args])
        == 0
    )
    first, second = load_all(tmp_path / "a"), load_all(tmp_path / "c")
    assert all(fp8_blockwise.is_pow2(t) for n, t in first.items() if n.endswith("_scale_inv"))
    assert first.keys() == second.keys()
    for name in first:
        assert torch.equal(first[name].view(torch.uint8) if first[name].dtype == torch.float8_e4m3fn else first[name],
                           second[name].view(torch.uint8) if second[name].dtype == torch.float8_e4m3fn else second[name]), name  # fmt: skip


def test_rerun_on_a_finished_output_is_byte_identical_and_writes_nothing(
    qwen_bf16, qwen_fp8, tmp_path, capsys
):
    before = dir_bytes(qwen_fp8)
    assert convert_hf_to_fp8.main(["--model-dir", str(qwen_bf16), "--save-dir", str(qwen_fp8)]) == 0
    assert "0 shards written" in capsys.readouterr().out
    assert dir_bytes(qwen_fp8) == before


def test_transformers_loads_our_fp8_output_with_logits_close_to_bf16(qwen_bf16, qwen_fp8, monkeypatch):
    import transformers.quantizers.quantizer_finegrained_fp8 as fp8_quantizer
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    # accelerate is not a skyq dependency; transformers' CPU dequantize path does not use it.
    monkeypatch.setattr(fp8_quantizer, "is_accelerate_available", lambda: True)
    ref = AutoModelForCausalLM.from_pretrained(qwen_bf16, dtype=torch.bfloat16)
    served = AutoModelForCausalLM.from_pretrained(
        qwen_fp8, quantization_config=FineGrainedFP8Config(dequantize=True), dtype=torch.bfloat16
    )
    ours = load_all(qwen_fp8)
    name = "model.layers.1.self_attn.q_proj.weight"
    expected = fp8_blockwise.dequantize(ours[name], ours[name + "_scale_inv"], block_size=(128, 128))
    assert torch.equal(served.get_parameter(name), expected)  # transformers reads our scales as we mean them
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = ref(tokens).logits.float(), served(tokens).logits.float()
    assert torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0) > 0.99
    assert (a - b).abs().max() < 0.15 * a.abs().max()


def test_int4_release_to_bf16_matches_compressed_tensors_and_the_original(
    kimi_bf16, kimi_int4_release, tmp_path
):
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig

    out = tmp_path / "bf16"
    assert (
        convert_moe_int4_to_bf16.main(["--model-dir", str(kimi_int4_release), "--output-dir", str(out)]) == 0
    )
    release, back, original = load_all(kimi_int4_release), load_all(out), load_all(kimi_bf16)
    block = json.loads((kimi_int4_release / "config.json").read_text())["text_config"]["quantization_config"]
    scheme = QuantizationConfig.model_validate(block).config_groups["group_0"]
    packed = sorted(n.removesuffix(".weight_packed") for n in release if n.endswith(".weight_packed"))
    assert len(packed) == 12 and all(".mlp.experts." in n for n in packed)
    for base in packed:
        members = {m: release[f"{base}.{m}"] for m in ("weight_packed", "weight_scale", "weight_shape")}
        ct = PackedQuantizationCompressor.decompress(members, scheme)["weight"]
        assert torch.equal(ct.to(torch.bfloat16), back[base + ".weight"]), base
        w = original[base + ".weight"].float()
        scale = release[base + ".weight_scale"].float().repeat_interleave(32, dim=1)
        assert ((back[base + ".weight"].float() - w).abs() <= scale * 0.5 + w.abs() * 2**-7).all(), base
    assert back.keys() == original.keys()
    assert all(torch.equal(back[n], t) for n, t in original.items() if n.rsplit(".", 1)[0] not in packed)
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config["text_config"] and "quantization_config" not in config
    sidecar = json.loads((out / "quantization_config.json").read_text())
    assert {"re:vision_tower\\..*", "re:mm_projector\\..*"} <= set(sidecar["ignore"])
    assert sidecar["config_groups"] == block["config_groups"]


def test_int4_requantizing_the_dequantized_weights_is_a_fixed_point(kimi_int4_release, tmp_path):
    assert (
        convert_moe_int4_to_bf16.main(
            ["--model-dir", str(kimi_int4_release), "--output-dir", str(tmp_path / "b")]
        )
        == 0
    )
    assert (
        convert_hf_to_int4.main(["--model-dir", str(tmp_path / "b"), "--save-dir", str(tmp_path / "c")]) == 0
    )
    first, second = load_all(kimi_int4_release), load_all(tmp_path / "c")
    for name in (n for n in first if n.endswith((".weight_packed", ".weight_scale"))):
        assert torch.equal(first[name], second[name]), name


def test_int4_output_layout_and_config(kimi_bf16, tmp_path):
    out = tmp_path / "int4"
    assert (
        convert_hf_to_int4.main(
            ["--model-dir", str(kimi_bf16), "--save-dir", str(out), "--group-size", "32", "--is-symmetric"]
        )
        == 0
    )
    t = load_all(out)
    base = "language_model.model.layers.1.mlp.experts.2.down_proj"
    assert t[base + ".weight_packed"].dtype == torch.int32 and t[base + ".weight_packed"].shape == (128, 16)
    assert t[base + ".weight_scale"].dtype == torch.bfloat16 and t[base + ".weight_scale"].shape == (128, 4)
    assert t[base + ".weight_shape"].dtype == torch.int64 and t[base + ".weight_shape"].tolist() == [128, 128]
    block = json.loads((out / "config.json").read_text())["quantization_config"]
    weights = block["config_groups"]["group_0"]["weights"]
    assert (block["format"], weights["symmetric"], weights["group_size"]) == ("pack-quantized", True, 32)
    assert any(matches_ignore_rule("language_model.model.layers.1.mlp.gate", r) for r in block["ignore"])
    assert not any(".mlp.experts." in rule for rule in block["ignore"])


def test_asymmetric_int4_warns_and_reads_back_with_zero_points(kimi_bf16, tmp_path, capsys):
    out = tmp_path / "asym"
    assert (
        convert_hf_to_int4.main(["--model-dir", str(kimi_bf16), "--save-dir", str(out), "--asymmetric"]) == 0
    )
    assert "cannot serve INT4 QAT" in capsys.readouterr().err
    assert convert_moe_int4_to_bf16.main(["--model-dir", str(out), "--output-dir", str(tmp_path / "b")]) == 0
    q, back, original = load_all(out), load_all(tmp_path / "b"), load_all(kimi_bf16)
    base = "language_model.model.layers.1.mlp.experts.0.up_proj"
    expected = int4.dequantize_asymmetric(q[base + ".weight_packed"], q[base + ".weight_scale"],
                                          q[base + ".weight_zero_point"], [128, 128])  # fmt: skip
    assert torch.equal(back[base + ".weight"], expected)
    scale = q[base + ".weight_scale"].float().repeat_interleave(32, dim=1)
    assert (
        (back[base + ".weight"].float() - original[base + ".weight"].float()).abs() <= scale * 1.01 + 1e-6
    ).all()


def test_files_subset_writes_index_only_once_every_shard_is_done(kimi_int4_release, tmp_path, capsys):
    shards = ShardedCheckpoint(kimi_int4_release).shard_names
    out = tmp_path / "bf16"
    args = ["--model-dir", str(kimi_int4_release), "--output-dir", str(out)]
    assert convert_moe_int4_to_bf16.main([*args, "--files", *shards[:3]]) == 0
    assert not (out / INDEX).exists() and "still to convert" in capsys.readouterr().out
    assert convert_moe_int4_to_bf16.main([*args, "--files", *shards[3:]]) == 0
    reference = tmp_path / "ref"
    assert (
        convert_moe_int4_to_bf16.main(["--model-dir", str(kimi_int4_release), "--output-dir", str(reference)])
        == 0
    )
    assert dir_bytes(out) == dir_bytes(reference)
