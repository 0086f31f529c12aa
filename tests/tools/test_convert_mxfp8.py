"""convert_hf_to_mxfp8: round trip, the strategy's bytes and config block, what engines and the
config validation accept, inspect, mxfp8 -> bf16 and bad input."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from checkpoint.tiny_checkpoints import INDEX, load_all
from compressed_tensors.quantization import QuantizationConfig
from safetensors.torch import load_file, save_file

from skyq.checkpoint.hf_config import model_config_from_hf
from skyq.checkpoint.reader import ShardedCheckpoint
from skyq.config.checkpoint_rules import checkpoint_errors
from skyq.config.enums import Precision, QuantScope
from skyq.config.schema import CheckpointConfig, ModelConfig, PrecisionConfig
from skyq.quant import mxfp8
from skyq.quant.layouts import get_layout
from skyq.quant.plan import build_plan
from skyq.quant.strategies import get_strategy
from skyq.tools import convert_fp8_to_bf16, convert_hf_to_mxfp8, inspect
from skyq.tools.cli import run_tool

MX = PrecisionConfig(name=Precision.mxfp8)


def _model_of(directory: Path) -> ModelConfig:
    """The run's model config that matches the checkpoint in `directory` (from its config.json)."""
    return model_config_from_hf(json.loads((directory / "config.json").read_text()))


@pytest.fixture(scope="module")
def mx_out(tmp_path_factory, qwen_bf16, kimi_bf16) -> dict[str, Path]:
    """Default-scope MXFP8 output of each tiny model."""
    root = tmp_path_factory.mktemp("mxfp8")
    out = {}
    for model, src in (("qwen", qwen_bf16), ("kimi", kimi_bf16)):
        out[model] = root / model
        args = ["--model-dir", str(src), "--save-dir", str(out[model]), "--max-workers", "2"]
        assert convert_hf_to_mxfp8.main(args) == 0
    return out


def _mx_error_bound(w: torch.Tensor, scale_u8: torch.Tensor) -> torch.Tensor:
    """e4m3 keeps 3 mantissa bits (relative error <= 2^-4); its subnormal step is 2^-9 * 2^e."""
    step = mxfp8.exp2(scale_u8.to(torch.int32) - 127).repeat_interleave(mxfp8.BLOCK, -1) * 2**-10
    return w.abs() * 2**-4 + step


@pytest.mark.parametrize("model", ["qwen", "kimi"])
def test_round_trip_within_mxfp8_bound_and_bytes_are_the_strategy_serialize(
    model, qwen_bf16, kimi_bf16, mx_out
):
    source = qwen_bf16 if model == "qwen" else kimi_bf16
    original, out = load_all(source), load_all(mx_out[model])
    model_cfg = model_config_from_hf(json.loads((source / "config.json").read_text()))
    layout, strategy = get_layout(model_cfg.family), get_strategy(MX)
    quantized = {n for n, t in out.items() if t.dtype == torch.float8_e4m3fn}
    assert quantized and all(".mlp.experts." in n for n in quantized)
    assert set(out) == set(original) | {n + "_scale" for n in quantized}
    for name, w in original.items():
        if name not in quantized:
            assert torch.equal(out[name], w), f"{name} must pass through unchanged"
            continue
        scale = out[name + "_scale"]
        assert scale.dtype == torch.uint8 and scale.shape == (w.shape[0], w.shape[1] // 32)
        back = mxfp8.dequantize(out[name], scale, dtype=torch.float32, name=name)
        assert ((back - w.float()).abs() <= _mx_error_bound(w.float(), scale)).all(), name
        wire = strategy.serialize(name, w, role=layout.role(name, model_cfg))
        assert torch.equal(out[name].view(torch.uint8), wire[name].view(torch.uint8)), name
        assert torch.equal(scale, wire[name + "_scale"]), name
    if model == "kimi":
        assert any(n.startswith("vision_tower") for n in out)
        assert all(
            out[n].dtype == torch.bfloat16 for n in out if n.startswith(("vision_tower", "mm_projector"))
        )


def test_config_block_is_the_strategy_block_and_compressed_tensors_accepts_it(kimi_bf16, mx_out):
    config = json.loads((mx_out["kimi"] / "config.json").read_text())
    block = config["quantization_config"]
    plan = build_plan(model_config_from_hf(config), MX)
    assert block == json.loads(json.dumps(get_strategy(MX).quantization_config(plan)))
    assert (
        block["format"] == "mxfp8-quantized"
        and block["config_groups"]["group_0"]["weights"]["group_size"] == 32
    )
    parsed = QuantizationConfig.model_validate(block)
    assert parsed.format == "mxfp8-quantized" and parsed.config_groups["group_0"].weights.num_bits == 8
    assert any("vision_tower" in rule for rule in block["ignore"])


def test_all_linear_targets_widen_the_scope(qwen_bf16, tmp_path):
    out = tmp_path / "all"
    assert convert_hf_to_mxfp8.main(["--model-dir", str(qwen_bf16), "--save-dir", str(out), "--targets", "all_linear"]) == 0  # fmt: skip
    quantized = {n for n, t in load_all(out).items() if t.dtype == torch.float8_e4m3fn}
    assert any("self_attn" in n for n in quantized) and not any(".mlp.gate." in n for n in quantized)
    errors, _ = checkpoint_errors(
        precision=PrecisionConfig(name=Precision.mxfp8, mxfp8_targets=QuantScope.all_linear),
        model=_model_of(out),
        checkpoint=CheckpointConfig(rollout_checkpoint=str(out)),
    )
    assert errors == []


def test_config_validation_accepts_the_output_as_mxfp8_rollout_checkpoint(qwen_bf16, mx_out, capsys):
    for model in ("qwen", "kimi"):
        errors, skipped = checkpoint_errors(
            precision=MX, model=_model_of(mx_out[model]),
            checkpoint=CheckpointConfig(rollout_checkpoint=str(mx_out[model])),
        )  # fmt: skip
        assert errors == [] and skipped == []
    errors, _ = checkpoint_errors(
        precision=MX,
        model=_model_of(qwen_bf16),
        checkpoint=CheckpointConfig(rollout_checkpoint=str(qwen_bf16)),
    )
    assert len(errors) == 1 and "python -m skyq.tools.convert_hf_to_mxfp8" in errors[0]
    for model in ("qwen", "kimi"):
        assert inspect.main([str(mx_out[model]), "--verify"]) == 0
        report = capsys.readouterr().out
        assert "format: mxfp8 e4m3" in report and "no problems found" in report


def test_inspect_counts_roles_and_flags_an_e8m0_nan_byte(mx_out, tmp_path, capsys):
    assert inspect.main([str(mx_out["qwen"])]) == 0
    assert "routed_expert  quantized     24  kept      0" in capsys.readouterr().out
    model = shutil.copytree(mx_out["qwen"], tmp_path / "m")
    name = "model.layers.0.mlp.experts.2.up_proj.weight_scale"
    shard = model / ShardedCheckpoint(model).tensors[name].shard
    tensors = load_file(str(shard))
    tensors[name][3, 1] = 0xFF
    save_file(tensors, str(shard), metadata={"format": "pt"})
    assert inspect.main([str(model)]) == 1
    assert f"scale {name!r}" in capsys.readouterr().out


def test_fp8_to_bf16_dequantizes_mxfp8_output(mx_out, tmp_path):
    out = tmp_path / "bf16"
    assert convert_fp8_to_bf16.main(["--model-dir", str(mx_out["kimi"]), "--save-dir", str(out)]) == 0
    mx, back = load_all(mx_out["kimi"]), load_all(out)
    assert not any(n.endswith("_scale") for n in back)
    for name, t in back.items():
        want = mxfp8.dequantize(mx[name], mx[name + "_scale"]) if name + "_scale" in mx else mx[name]
        assert torch.equal(t, want), name
    assert "quantization_config" not in json.loads((out / "config.json").read_text())


def _refused(model: Path, out: Path, capsys, *needles: str) -> None:
    """Refused naming `needles`, leaving no index or config under `out` (when it is not the model dir)."""
    assert run_tool(convert_hf_to_mxfp8.main, ["--model-dir", str(model), "--save-dir", str(out)]) == 2
    err = capsys.readouterr().err
    assert all(n in err for n in needles), err
    if out != model and out.exists():
        assert not {p.name for p in out.iterdir()} & {INDEX, "config.json"}


def _rewrite(model: Path, name: str, fn) -> None:
    shard = model / ShardedCheckpoint(model).tensors[name].shard
    tensors = load_file(str(shard))
    tensors[name] = fn(tensors[name])
    save_file(tensors, str(shard), metadata={"format": "pt"})


def test_k_not_a_multiple_of_32_is_refused_with_the_arithmetic(qwen_bf16, tmp_path, capsys):
    model = shutil.copytree(qwen_bf16, tmp_path / "m")
    name = "model.layers.1.mlp.experts.0.down_proj.weight"
    _rewrite(model, name, lambda t: t[:, :120].contiguous())
    _refused(model, tmp_path / "o", capsys, name, "K = 120 = 3 * 32 + 24")
    assert not (tmp_path / "o").exists()


def test_nan_weight_is_refused_naming_the_tensor(qwen_bf16, tmp_path, capsys):
    model = shutil.copytree(qwen_bf16, tmp_path / "m")
    name = "model.layers.1.mlp.experts.3.down_proj.weight"
    _rewrite(model, name, lambda t: t.index_put_((torch.tensor([5]), torch.tensor([7])), torch.tensor(float("nan"), dtype=t.dtype)))  # fmt: skip
    _refused(model, tmp_path / "o", capsys, name, "NaN")


@pytest.mark.parametrize("where", ["same", "inside"])
def test_save_dir_equal_to_or_inside_model_dir_is_refused(where, qwen_bf16, tmp_path, capsys):
    model = shutil.copytree(qwen_bf16, tmp_path / "m")
    before = sorted(p.name for p in model.iterdir())
    _refused(model, model if where == "same" else model / "mx", capsys, "overlaps the model dir")
    assert sorted(p.name for p in model.iterdir()) == before


def test_already_quantized_input_is_refused(mx_out, tmp_path, capsys):
    _refused(mx_out["qwen"], tmp_path / "o", capsys, "already quantized")
