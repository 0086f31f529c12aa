"""The tiny checkpoint: a real HF checkpoint, built once per config, deterministic for a seed."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import Qwen3MoeForCausalLM

from skyq.quant.layouts import get_layout
from skyq.trainer.native import tiny_checkpoint as tiny_module
from skyq.trainer.native.model import ModelBuildError, load_model
from skyq.trainer.native.tiny_checkpoint import ensure_tiny_checkpoint


def _sha(path: Path) -> str:
    return hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()


def test_checkpoint_is_a_real_hf_checkpoint_with_per_expert_tensors(run_cfg, tiny_checkpoint):
    cfg = run_cfg()
    path = Path(tiny_checkpoint)
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        dtypes = {f.get_tensor(n).dtype for n in names}
    assert names == {spec.name for spec in get_layout(cfg.model.family).hf_parameters(cfg.model)}
    assert "model.layers.0.mlp.experts.3.down_proj.weight" in names
    assert dtypes == {torch.bfloat16}
    hf_model = Qwen3MoeForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    ours = load_model(path, cfg.model)
    ids = torch.tensor([[1, 5, 13, 7, 18]])
    assert torch.equal(hf_model(input_ids=ids).logits, ours(input_ids=ids).logits)
    info = json.loads((path / tiny_module.INFO_FILE).read_text())
    assert info["sft_steps"] == 100 and info["sft_last_loss"] < info["sft_first_loss"]


def test_checkpoint_is_built_once_then_reused(run_cfg, tmp_path, monkeypatch):
    model_cfg = dataclasses.replace(run_cfg().model, init_sft_steps=2)
    first = ensure_tiny_checkpoint(model_cfg, run_cfg().task, cache_dir=tmp_path)

    def refuse_rebuild(*args, **kwargs):
        raise AssertionError("a cached checkpoint was rebuilt")

    monkeypatch.setattr(tiny_module, "_build", refuse_rebuild)
    assert ensure_tiny_checkpoint(model_cfg, run_cfg().task, cache_dir=tmp_path) == first
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no staging leftovers


def test_checkpoint_is_deterministic_for_a_seed_and_keyed_by_it(run_cfg, tmp_path):
    model_cfg, task_cfg = dataclasses.replace(run_cfg().model, init_sft_steps=3), run_cfg().task
    a = ensure_tiny_checkpoint(model_cfg, task_cfg, cache_dir=tmp_path / "a")
    b = ensure_tiny_checkpoint(model_cfg, task_cfg, cache_dir=tmp_path / "b")
    assert a.name == b.name and _sha(a) == _sha(b)
    other_seed = ensure_tiny_checkpoint(
        dataclasses.replace(model_cfg, init_seed=1), task_cfg, cache_dir=tmp_path / "a"
    )
    assert other_seed.name != a.name and _sha(other_seed) != _sha(a)


def test_load_model_refuses_a_checkpoint_of_another_architecture(run_cfg, tiny_checkpoint):
    wider = dataclasses.replace(run_cfg().model, num_experts=8)
    with pytest.raises(ModelBuildError, match="num_experts"):
        load_model(tiny_checkpoint, wider)
