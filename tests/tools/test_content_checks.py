"""What the quantizing converters check in a checkpoint's content before they write, and the one
owner of every `quantization_config` they write (the precision's strategy)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from checkpoint.tiny_checkpoints import load_all
from compressed_tensors.quantization import QuantizationConfig
from safetensors.torch import load_file, save_file

from skyq.checkpoint.fp8_convert import Fp8Options, Fp8Strategy, merged_row_warnings
from skyq.checkpoint.int4_convert import Int4Options
from skyq.checkpoint.reader import ShardedCheckpoint, TensorInfo
from skyq.config.enums import Int4Grid, Precision, QuantScope
from skyq.config.schema import PrecisionConfig
from skyq.quant.layouts import Role
from skyq.quant.plan import build_plan
from skyq.quant.strategies import get_strategy
from skyq.tools import convert_hf_to_fp8, convert_hf_to_int4, convert_hf_to_mxfp8
from skyq.tools.cli import checkpoint_model_config, run_tool

CONVERTERS = {"fp8": convert_hf_to_fp8, "int4": convert_hf_to_int4, "mxfp8": convert_hf_to_mxfp8}
EXPERT = "model.layers.1.mlp.experts.2.up_proj.weight"


def _rewrite(model: Path, name: str, fn) -> None:
    shard = model / ShardedCheckpoint(model).tensors[name].shard
    tensors = load_file(str(shard))
    tensors[name] = fn(tensors[name])
    save_file(tensors, str(shard), metadata={"format": "pt"})


def _refused_writing_nothing(tool, model: Path, out: Path, capsys, *args: str) -> str:
    assert run_tool(tool.main, ["--model-dir", str(model), "--save-dir", str(out), *args]) == 2
    err = capsys.readouterr().err
    assert not out.exists() or not any(out.iterdir()), sorted(p.name for p in out.iterdir())
    return err


# ---- item: every tensor's dtype and rank, before the first write -------------------------------


@pytest.mark.parametrize("tool", sorted(CONVERTERS))
@pytest.mark.parametrize(
    ("name", "bad", "says"),
    [
        (EXPERT, lambda t: t.flatten(), "2-D"),  # would stay bf16 under a config that says quantized
        (EXPERT, lambda t: t.unsqueeze(0), "2-D"),
        (EXPERT, lambda t: t.to(torch.int64), "is I64"),
        ("model.layers.0.post_attention_layernorm.weight", lambda t: t.to(torch.int64), "is I64"),
        ("model.layers.0.input_layernorm.weight", lambda t: t > 0, "is BOOL"),  # was copied silently
    ],
    ids=["1d-expert", "3d-expert", "int64-expert", "int64-norm", "bool-norm"],
)
def test_bad_dtype_or_rank_is_refused_before_anything_is_written(
    tool, name, bad, says, qwen_bf16, tmp_path, capsys
):
    model = shutil.copytree(qwen_bf16, tmp_path / "m")
    _rewrite(model, name, bad)
    err = _refused_writing_nothing(CONVERTERS[tool], model, tmp_path / "o", capsys)
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert repr(name) in err and says in err, err


# ---- item: asymmetric INT4 scale overflow -------------------------------------------------------


def test_asymmetric_int4_refuses_a_range_overflowing_fp32_with_nothing_written(qwen_bf16, tmp_path, capsys):
    model = shutil.copytree(qwen_bf16, tmp_path / "m")

    def huge(t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        t[3, 40], t[3, 41] = 3e38, -3e38  # max - min = 6e38 > FLT_MAX
        return t

    _rewrite(model, EXPERT, huge)
    out = tmp_path / "o"
    assert (
        run_tool(convert_hf_to_int4.main, ["--model-dir", str(model), "--save-dir", str(out), "--asymmetric"])
        == 2
    )
    err = capsys.readouterr().err
    assert f"{EXPERT}[3, 32:64]" in err and "overflow" in err, err
    assert not (out / "config.json").exists()
    assert all(torch.isfinite(t).all() for n, t in load_all(out).items() if n.endswith("_scale"))


# ---- item: merged projections whose rows vLLM refuses with blockwise FP8 ------------------------


def _info(name: str, rows: int) -> TensorInfo:
    return TensorInfo(name=name, shard="s.safetensors", dtype="BF16", shape=(rows, 256), nbytes=0)


def test_merged_rows_not_a_multiple_of_the_block_warn_with_the_arithmetic():
    attn = "model.layers.0.self_attn."
    expert = "model.layers.0.mlp.experts.0."
    tensors = {
        attn + "q_proj.weight": _info(attn + "q_proj.weight", 320),
        attn + "k_proj.weight": _info(attn + "k_proj.weight", 128),
        attn + "v_proj.weight": _info(attn + "v_proj.weight", 64),
        attn + "o_proj.weight": _info(attn + "o_proj.weight", 320),  # not merged: never warned
        expert + "gate_proj.weight": _info(expert + "gate_proj.weight", 256),
        expert + "up_proj.weight": _info(expert + "up_proj.weight", 192),
    }
    roles = {n: Role.routed_expert if "experts" in n else Role.attention for n in tensors}
    warnings = merged_row_warnings(frozenset(tensors), tensors, roles, block_rows=128)
    assert len(warnings) == 3, warnings
    q, up, v = (next(w for w in warnings if f" {p} weight(s)" in w) for p in ("q_proj", "up_proj", "v_proj"))
    assert "q_proj rows=320 / 1 (engine TP) = 320, NOT a multiple of 128" in q and "every TP" in q
    assert "(e.g. 64)" in q
    assert "up_proj rows=192" in up and "every TP" in up  # routed experts (w13): no exemption
    assert "v_proj rows=64" in v and "TP 1 only" in v  # the last member of a merged linear
    assert merged_row_warnings(frozenset(tensors), tensors, roles, block_rows=64) == []


def test_fp8_converter_prints_the_merged_rows_warning(qwen_bf16, tmp_path, capsys):
    assert convert_hf_to_fp8.main(["--model-dir", str(qwen_bf16), "--save-dir", str(tmp_path / "a")]) == 0
    err = capsys.readouterr().err
    assert "k_proj rows=64 / 1 (engine TP) = 64, NOT a multiple of 128 (--block-size BN)" in err, err
    assert "v_proj rows=64" in err and "q_proj" not in err.split("merged as")[0]
    args = ["--model-dir", str(qwen_bf16), "--save-dir", str(tmp_path / "b"), "--block-size", "64", "64"]
    assert convert_hf_to_fp8.main(args) == 0
    assert "warning" not in capsys.readouterr().err


# ---- item: the strategy is the one owner of every quantization_config --------------------------

FP8_CASES = {
    "block": ([], Fp8Options()),
    "block-ue8m0": (["--scale-fmt", "ue8m0"], Fp8Options(pow2_scales=True)),
    "block-64": (["--block-size", "64", "64"], Fp8Options(block_size=(64, 64))),
    "tensor": (["--strategy", "tensor"], Fp8Options(strategy=Fp8Strategy.tensor)),
    "channel": (["--strategy", "channel"], Fp8Options(strategy=Fp8Strategy.channel)),
}


def _written_block(tool, source: Path, out: Path, args: list[str]) -> dict:
    assert tool.main(["--model-dir", str(source), "--save-dir", str(out), *args]) == 0
    return json.loads((out / "config.json").read_text())["quantization_config"]


def _strategy_block(source: Path, precision: PrecisionConfig) -> tuple[dict, object]:
    plan = build_plan(checkpoint_model_config(ShardedCheckpoint(source)), precision)
    return json.loads(json.dumps(get_strategy(precision).quantization_config(plan))), plan


@pytest.mark.parametrize("case", sorted(FP8_CASES))
def test_fp8_converter_writes_the_strategy_block(case, qwen_bf16, tmp_path):
    args, opts = FP8_CASES[case]
    written = _written_block(convert_hf_to_fp8, qwen_bf16, tmp_path / "o", args)
    expected, plan = _strategy_block(qwen_bf16, opts.precision_config())
    if opts.strategy is Fp8Strategy.block:
        assert written == expected
    elif opts.strategy is Fp8Strategy.tensor:  # the block without a block size: one scale per tensor
        assert written == {k: v for k, v in expected.items() if k != "weight_block_size"}
    else:  # compressed-tensors per-channel: no run precision serves it, its ignore list is the plan's
        assert written["ignore"] == plan.ignore_list()
        weights = QuantizationConfig.model_validate(written).config_groups["group_0"].weights
        assert (weights.strategy, weights.num_bits, weights.type) == ("channel", 8, "float")


@pytest.mark.parametrize("model", ["qwen", "kimi"])
@pytest.mark.parametrize("option", ["default", "g128-rtn", "asymmetric", "ignore-rules"])
def test_int4_converter_writes_the_strategy_block(model, option, qwen_bf16, kimi_bf16, tmp_path):
    source, prefix = (qwen_bf16, "") if model == "qwen" else (kimi_bf16, "language_model.")
    args, opts, rules = [], Int4Options(group_size=32), []
    if option == "g128-rtn":
        args, opts = ["--group-size", "128", "--grid", "rtn"], Int4Options(group_size=128, grid=Int4Grid.rtn)
    elif option == "asymmetric":
        args, opts = ["--asymmetric"], Int4Options(group_size=32, symmetric=False)
    elif option == "ignore-rules":
        rules = [r"re:.*layers\.1\.mlp\.experts\.0\..*"]
        args = ["--ignore-rules", *rules]
    written = _written_block(convert_hf_to_int4, source, tmp_path / "o", args)
    expected, _ = _strategy_block(source, opts.precision_config())
    expected["ignore"] += rules  # the user's rules, verbatim, after the plan's
    expected["config_groups"]["group_0"]["weights"]["symmetric"] = opts.symmetric
    assert written == expected
    if rules:  # and the rule did keep those experts bf16
        assert (
            load_all(tmp_path / "o")[f"{prefix}model.layers.1.mlp.experts.0.up_proj.weight"].dtype
            == torch.bfloat16
        )


@pytest.mark.parametrize("targets", [s.value for s in QuantScope])
def test_mxfp8_converter_writes_the_strategy_block(targets, kimi_bf16, tmp_path):
    written = _written_block(convert_hf_to_mxfp8, kimi_bf16, tmp_path / "o", ["--targets", targets])
    expected, _ = _strategy_block(
        kimi_bf16, PrecisionConfig(name=Precision.mxfp8, mxfp8_targets=QuantScope(targets))
    )
    assert written == expected


def test_the_int4_strategy_block_means_what_the_former_converter_block_meant(qwen_bf16):
    """compressed-tensors (from which vLLM builds its scheme) fills `actorder`, `block_structure`,
    `observer_kwargs` and `output_activations` with the values the converter used to write, so the
    strategy's block (FORMATS.md's fields) is the same scheme to the engine."""
    block, _ = _strategy_block(qwen_bf16, PrecisionConfig(name=Precision.int4_qat, int4_group_size=32))
    full = json.loads(json.dumps(block))
    group = full["config_groups"]["group_0"]
    group["output_activations"] = None
    group["weights"].update(actorder=None, block_structure=None, observer_kwargs={})
    assert QuantizationConfig.model_validate(block) == QuantizationConfig.model_validate(full)
