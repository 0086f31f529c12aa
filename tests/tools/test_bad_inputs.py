"""Bad input is refused naming the file or tensor, and nothing partial appears under a final name."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from checkpoint.tiny_checkpoints import INDEX, load_all, write_sharded
from safetensors.torch import load_file, save_file

from skyq.checkpoint.atomic import TEMP_MARKER
from skyq.checkpoint.manifest import MANIFEST_NAME
from skyq.checkpoint.reader import ShardedCheckpoint
from skyq.tools import (
    convert_fp8_to_bf16,
    convert_hf_to_fp8,
    convert_hf_to_int4,
    convert_moe_int4_to_bf16,
    inspect,
)
from skyq.tools.cli import run_tool

TOOLS = {
    "fp8": convert_hf_to_fp8.main,
    "int4": convert_hf_to_int4.main,
    "fp8_to_bf16": convert_fp8_to_bf16.main,
}


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _assert_refused(
    tool, model: Path, out: Path, capsys, *needles: str, out_flag: str = "--save-dir"
) -> None:
    assert run_tool(tool, ["--model-dir", str(model), out_flag, str(out)]) == 2
    err = capsys.readouterr().err
    for needle in needles:
        assert needle in err, err
    if out.exists():  # nothing half-written, no index/config: the output is not a checkpoint
        names = {p.name for p in out.iterdir()}
        assert not any(TEMP_MARKER in n for n in names)
        assert not names & {INDEX, "config.json", MANIFEST_NAME}
        for p in out.glob("*.safetensors"):
            load_file(str(p))  # every final-named shard is complete


def _rewrite_tensor(model: Path, name: str, fn) -> str:
    """Apply `fn` to one tensor in place (`fn` returning None deletes it, index updated)."""
    ckpt = ShardedCheckpoint(model)
    shard = ckpt.tensors[name].shard
    tensors = load_file(str(model / shard))
    new = fn(tensors[name])
    if new is None:
        del tensors[name]
        index = json.loads((model / INDEX).read_text())
        del index["weight_map"][name]
        (model / INDEX).write_text(json.dumps(index))
    else:
        tensors[name] = new
    save_file(tensors, str(model / shard), metadata={"format": "pt"})
    return shard


@pytest.mark.parametrize("tool", ["fp8", "int4"])
def test_truncated_input_shard_is_refused_naming_it(tool, qwen_bf16, tmp_path, capsys):
    model = _copy(qwen_bf16, tmp_path / "m")
    victim = sorted(model.glob("*.safetensors"))[3]
    victim.write_bytes(victim.read_bytes()[:-100])
    _assert_refused(TOOLS[tool], model, tmp_path / "out", capsys, victim.name, "truncated or corrupt")


def test_shard_missing_from_index_is_refused(qwen_bf16, tmp_path, capsys):
    model = _copy(qwen_bf16, tmp_path / "m")
    index = json.loads((model / INDEX).read_text())
    dropped = sorted(set(index["weight_map"].values()))[2]
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v != dropped}
    (model / INDEX).write_text(json.dumps(index))
    _assert_refused(convert_hf_to_fp8.main, model, tmp_path / "out", capsys, dropped, "missing from")


@pytest.mark.parametrize("tool", ["fp8", "int4"])
def test_nan_or_inf_weight_is_refused_naming_the_tensor(tool, qwen_bf16, tmp_path, capsys):
    model = _copy(qwen_bf16, tmp_path / "m")
    name = "model.layers.1.mlp.experts.3.down_proj.weight"
    _rewrite_tensor(
        model,
        name,
        lambda t: t.index_put_(
            (torch.tensor([5]), torch.tensor([7])), torch.tensor(float("nan"), dtype=t.dtype)
        ),
    )
    _assert_refused(TOOLS[tool], model, tmp_path / "out", capsys, name, "NaN")


def test_inf_in_a_kept_tensor_is_refused(qwen_bf16, tmp_path, capsys):
    model = _copy(qwen_bf16, tmp_path / "m")
    name = "model.layers.0.input_layernorm.weight"
    _rewrite_tensor(model, name, lambda t: torch.full_like(t, float("inf")))
    _assert_refused(convert_hf_to_fp8.main, model, tmp_path / "out", capsys, name)


def test_fp8_weight_without_its_scale_is_refused_not_kept(kimi_fp8_split, tmp_path, capsys):
    model = _copy(kimi_fp8_split, tmp_path / "m")
    name = "language_model.model.layers.1.mlp.experts.1.gate_proj.weight"
    _rewrite_tensor(model, name + "_scale_inv", lambda t: None)
    _assert_refused(convert_fp8_to_bf16.main, model, tmp_path / "out", capsys, name, "never kept as is")


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 0.0])
def test_non_finite_or_zero_fp8_scale_is_refused(bad, kimi_fp8_split, tmp_path, capsys):
    model = _copy(kimi_fp8_split, tmp_path / "m")
    name = "language_model.model.layers.0.self_attn.o_proj.weight_scale_inv"
    _rewrite_tensor(model, name, lambda t: torch.full_like(t, bad))
    _assert_refused(convert_fp8_to_bf16.main, model, tmp_path / "out", capsys, "o_proj")


def test_unknown_quant_method_is_refused(kimi_fp8_split, tmp_path, capsys):
    model = _copy(kimi_fp8_split, tmp_path / "m")
    config = json.loads((model / "config.json").read_text())
    config["quantization_config"]["quant_method"] = "awq"
    (model / "config.json").write_text(json.dumps(config))
    _assert_refused(convert_fp8_to_bf16.main, model, tmp_path / "out", capsys, "config.json", "'awq'")
    _assert_refused(
        convert_moe_int4_to_bf16.main, model, tmp_path / "out2", capsys, "'awq'", out_flag="--output-dir"
    )


def test_int4_packed_weight_without_scale_is_refused(kimi_int4_release, tmp_path, capsys):
    model = _copy(kimi_int4_release, tmp_path / "m")
    base = "language_model.model.layers.1.mlp.experts.3.up_proj"
    _rewrite_tensor(model, base + ".weight_scale", lambda t: None)
    _assert_refused(convert_moe_int4_to_bf16.main, model, tmp_path / "out", capsys, base + ".weight_packed",
                    out_flag="--output-dir")  # fmt: skip


def test_group_size_not_dividing_k_is_refused_with_the_arithmetic(qwen_bf16, tmp_path, capsys):
    assert run_tool(convert_hf_to_int4.main, ["--model-dir", str(qwen_bf16), "--save-dir", str(tmp_path / "o"),
                                              "--group-size", "48"]) == 2  # fmt: skip
    err = capsys.readouterr().err
    assert "K = 128 is not divisible by the group size 48" in err and "mlp.experts" in err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("where", ["same", "inside"])
def test_save_dir_equal_to_or_inside_model_dir_is_refused(where, qwen_bf16, tmp_path, capsys):
    model = _copy(qwen_bf16, tmp_path / "m")
    before = sorted(p.name for p in model.iterdir())
    out = model if where == "same" else model / "fp8"
    assert run_tool(convert_hf_to_fp8.main, ["--model-dir", str(model), "--save-dir", str(out)]) == 2
    assert "overlaps the model dir" in capsys.readouterr().err
    assert sorted(p.name for p in model.iterdir()) == before


def test_zero_filled_payload_of_a_skyq_checkpoint_is_caught_by_the_manifest(qwen_fp8, tmp_path, capsys):
    model = _copy(qwen_fp8, tmp_path / "m")
    victim = sorted(model.glob("*.safetensors"))[1]
    data = bytearray(victim.read_bytes())
    header = 8 + int.from_bytes(data[:8], "little")
    data[header:] = bytes(len(data) - header)  # safetensors itself still loads this file
    victim.write_bytes(bytes(data))
    load_file(str(victim))
    _assert_refused(convert_fp8_to_bf16.main, model, tmp_path / "out", capsys, victim.name, "sha256")
    assert inspect.main([str(model), "--verify"]) == 1
    assert victim.name in capsys.readouterr().out


def test_inspect_verify_passes_a_good_output_and_flags_a_bit_flip(qwen_fp8, tmp_path, capsys):
    assert inspect.main([str(qwen_fp8), "--verify"]) == 0
    report = capsys.readouterr().out
    assert "fp8 e4m3 blockwise [128, 128]" in report and "routed_expert  quantized     24" in report
    model = _copy(qwen_fp8, tmp_path / "m")
    victim = sorted(model.glob("*.safetensors"))[-1]
    data = bytearray(victim.read_bytes())
    data[-3] ^= 0x10
    victim.write_bytes(bytes(data))
    assert inspect.main([str(model), "--verify"]) == 1
    assert f"{victim.name}: sha256 differs" in capsys.readouterr().out


def test_inspect_flags_wrong_total_size_and_unlisted_unquantized_linear(qwen_fp8, tmp_path, capsys):
    model = _copy(qwen_fp8, tmp_path / "m")
    index = json.loads((model / INDEX).read_text())
    index["metadata"]["total_size"] = 12345
    (model / INDEX).write_text(json.dumps(index))
    config = json.loads((model / "config.json").read_text())
    config["quantization_config"]["modules_to_not_convert"].remove("lm_head")
    (model / "config.json").write_text(json.dumps(config))
    assert inspect.main([str(model)]) == 1
    out = capsys.readouterr().out
    assert "total_size=12345" in out and "'lm_head.weight'" in out


def test_all_zero_weight_gives_finite_scales_and_exact_zeros(tmp_path, qwen_bf16):
    model = _copy(qwen_bf16, tmp_path / "m")
    name = "model.layers.0.mlp.experts.0.gate_proj.weight"
    _rewrite_tensor(model, name, torch.zeros_like)
    assert convert_hf_to_fp8.main(["--model-dir", str(model), "--save-dir", str(tmp_path / "q")]) == 0
    assert (
        convert_fp8_to_bf16.main(["--model-dir", str(tmp_path / "q"), "--save-dir", str(tmp_path / "b")]) == 0
    )
    q = load_all(tmp_path / "q")
    assert torch.isfinite(q[name + "_scale_inv"]).all() and torch.equal(
        load_all(tmp_path / "b")[name], torch.zeros(128, 128, dtype=torch.bfloat16)
    )


def test_checkpoint_without_index_and_several_shards_is_refused(tmp_path, capsys):
    write_sharded(
        {"a.weight": torch.zeros(4, 4), "b.weight": torch.zeros(4, 4)}, tmp_path / "m", max_shard_bytes=1
    )
    (tmp_path / "m" / INDEX).unlink()
    _assert_refused(
        convert_hf_to_fp8.main, tmp_path / "m", tmp_path / "out", capsys, "no model.safetensors.index.json"
    )
