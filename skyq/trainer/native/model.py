"""Build and load the transformers Qwen3-MoE causal LM a skyq `ModelConfig` describes."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from skyq import ops
from skyq.checkpoint.atomic import atomic_write_bytes, atomic_write_json
from skyq.checkpoint.hf_config import ModelBuildError, hf_config
from skyq.config.schema import ModelConfig
from skyq.quant.layouts import get_layout


def build_model(
    model_cfg: ModelConfig, *, seed: int, dtype: torch.dtype = torch.float32
) -> Qwen3MoeForCausalLM:
    """A randomly initialized model; the init depends only on `seed` (not on global RNG state). Its
    norms and rotary embedding are skyq's (`skyq.ops.install`), as the engine's are."""
    config = hf_config(model_cfg)
    fork_devices: list[int] = []
    with torch.random.fork_rng(devices=fork_devices):
        torch.manual_seed(seed)
        model = Qwen3MoeForCausalLM(config)
    ops.install(model)
    return model.to(dtype)


_ARCHITECTURE_KEYS = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "head_dim", "moe_intermediate_size", "num_experts", "num_experts_per_tok", "norm_topk_prob",
    "tie_word_embeddings",
)  # fmt: skip


def check_checkpoint_config(path: str | Path, model_cfg: ModelConfig) -> None:
    """Refuse a checkpoint whose config.json disagrees with `model_cfg` on an architecture key."""
    if not (Path(path) / "config.json").is_file():
        raise ModelBuildError(f"{path}: no config.json; not an HF checkpoint directory")
    on_disk = Qwen3MoeConfig.from_pretrained(str(path))
    expected = hf_config(model_cfg)
    wrong = [
        f"{key}: checkpoint {getattr(on_disk, key)!r} != model config {getattr(expected, key)!r}"
        for key in _ARCHITECTURE_KEYS
        if getattr(on_disk, key) != getattr(expected, key)
    ]
    if wrong:
        raise ModelBuildError(
            f"{path} does not match the model config ({'; '.join(wrong)}); fix model.* or the path"
        )


def load_model(
    path: str | Path, model_cfg: ModelConfig, *, dtype: torch.dtype = torch.float32
) -> Qwen3MoeForCausalLM:
    """Load an HF checkpoint (single-file, per-expert safetensors) into the fused transformers model.

    Names go through the layout's `fuse_experts`, the same map the weight sync uses; every tensor of
    the model must be in the file and nothing else may be.
    """
    from safetensors.torch import load_file

    check_checkpoint_config(path, model_cfg)
    weights_file = Path(path) / "model.safetensors"
    if not weights_file.is_file():
        raise ModelBuildError(
            f"{path}: no model.safetensors (the native trainer reads single-file tiny checkpoints)"
        )
    trainer_tensors = get_layout(model_cfg.family).fuse_experts(load_file(str(weights_file)), model_cfg)
    model = build_model(model_cfg, seed=0, dtype=dtype)
    own = model.state_dict()
    missing, unexpected = sorted(set(own) - set(trainer_tensors)), sorted(set(trainer_tensors) - set(own))
    if missing or unexpected:
        raise ModelBuildError(
            f"{weights_file}: missing tensors {missing[:5]}, unexpected tensors {unexpected[:5]}"
        )
    for name, tensor in trainer_tensors.items():
        if tuple(tensor.shape) != tuple(own[name].shape):
            raise ModelBuildError(
                f"{weights_file}: {name} has shape {tuple(tensor.shape)}, the model needs {tuple(own[name].shape)}"
            )
    model.load_state_dict({name: t.to(dtype) for name, t in trainer_tensors.items()})
    return model


def write_hf_checkpoint(
    directory: str | Path, tensors: dict[str, torch.Tensor], model_cfg: ModelConfig
) -> Path:
    """Write `tensors` (HF names) as `model.safetensors` + `config.json` under `directory`.

    Crash-safe: each file is written to a temp name, fsynced and renamed; config.json goes last, so a
    directory with a config.json holds complete weights.
    """
    from safetensors.torch import save as safetensors_bytes

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    contiguous = {name: t.detach().contiguous() for name, t in tensors.items()}
    atomic_write_bytes(out / "model.safetensors", safetensors_bytes(contiguous, metadata={"format": "pt"}))
    config = hf_config(model_cfg).to_dict()
    config["architectures"] = ["Qwen3MoeForCausalLM"]
    config["dtype"] = "bfloat16"
    atomic_write_json(out / "config.json", config)
    return out
