"""Build and load the transformers causal LM a skyq `ModelConfig` describes (Qwen3-MoE, DeepSeek-V3), with
Kimi-K2.6's vision tower and projector beside it when `model.vision_num_layers` > 0 (`vision.py`).

The trainer holds the text model's parameters under their transformers names (no `text_prefix`, routed
experts fused); `hf_state` gives them back under the checkpoint's names and dtypes, through the
layout's `split_experts`, the same map the weight sync uses.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import Tensor, nn

from skyq import ops
from skyq.checkpoint.atomic import atomic_write_bytes, atomic_write_json
from skyq.checkpoint.hf_config import (
    HFConfigError,
    ModelBuildError,
    architecture_mismatches,
    causal_lm_class,
    checkpoint_config_json,
    hf_config,
)
from skyq.config.schema import ModelConfig
from skyq.quant.dtype_names import torch_dtype
from skyq.quant.layouts import ModelQuantizationLayout, get_layout, hf_dtype_name

ROUTER_BIAS = "e_score_correction_bias"
"""DeepSeek-V3's router bias: a buffer in transformers, a frozen parameter of skyq's models (see
`_router_bias_as_parameter`)."""
ROUTER_BIAS_INIT_STD = 0.02
"""Standard deviation of a freshly built model's router bias (added to sigmoid scores in [0, 1])."""


def build_model(model_cfg: ModelConfig, *, seed: int, dtype: torch.dtype = torch.float32) -> nn.Module:
    """A randomly initialized model; the init depends only on `seed` (not on global RNG state). Its
    ops are skyq's (`skyq.ops.install`), as the engine's are. Parameters whose checkpoint dtype is
    fp32 (DeepSeek-V3's router bias) stay fp32 whatever `dtype` is."""
    config = hf_config(model_cfg)
    fork_devices: list[int] = []
    with torch.random.fork_rng(devices=fork_devices):
        torch.manual_seed(seed)
        lm = model = causal_lm_class(model_cfg)(config)
        if model_cfg.vision_num_layers:
            from skyq.trainer.native.vision import VisionLanguageModel

            model = VisionLanguageModel(lm, model_cfg)
        _router_bias_as_parameter(model)
    ops.install(lm)
    kept = {name: model.get_parameter(name).detach().clone() for name in fp32_parameters(model, model_cfg)}
    model.to(dtype)
    for name, value in kept.items():
        model.get_parameter(name).data = value
    return model


def _router_bias_as_parameter(model: nn.Module) -> None:
    """DeepSeek-V3's `e_score_correction_bias` (a checkpoint tensor: the layout's `router_bias`) as a
    parameter that takes no gradient, so the trainer saves, sends and loads it with the weights.

    It is frozen: pre-training moves it by the auxiliary-loss-free balancing rule, not by gradients,
    and an RL update leaves the expert balance it encodes as the checkpoint has it."""
    for module in model.modules():
        bias = module._buffers.pop(ROUTER_BIAS, None)
        if bias is not None:
            # transformers initializes it to zeros; a random one (as a pre-trained model has) makes
            # a tiny model's routing depend on it, so a lost or bf16-rounded bias shows in tests.
            value = torch.randn(bias.shape, dtype=torch.float32) * ROUTER_BIAS_INIT_STD
            module.register_parameter(ROUTER_BIAS, nn.Parameter(value, requires_grad=False))


def fp32_parameters(model: nn.Module, model_cfg: ModelConfig) -> frozenset[str]:
    """Trainer names of the parameters the checkpoint keeps in fp32 (the router bias)."""
    layout = get_layout(model_cfg.family)
    return frozenset(
        name for name, _ in model.named_parameters() if hf_dtype(layout, name, model_cfg) == torch.float32
    )


def hf_dtype(layout: ModelQuantizationLayout, trainer_name: str, model_cfg: ModelConfig) -> torch.dtype:
    """The checkpoint dtype of a trainer parameter (bf16 but for the fp32 router bias)."""
    return torch_dtype(hf_dtype_name(layout.role(trainer_name, model_cfg)))


def hf_state(model: nn.Module, model_cfg: ModelConfig, *, device: str | None = None) -> dict[str, Tensor]:
    """{HF name: tensor} of every parameter in its checkpoint dtype: the checkpoint's and the
    wire's view of the model (routed experts as per-expert views, text names with `text_prefix`)."""
    layout = get_layout(model_cfg.family)
    state = {
        name: p.detach().to(device=device, dtype=hf_dtype(layout, name, model_cfg))
        for name, p in model.named_parameters()
    }
    return layout.split_experts(state, model_cfg)


def check_checkpoint_config(path: str | Path, model_cfg: ModelConfig) -> None:
    """Refuse a checkpoint whose config.json disagrees with `model_cfg` on an architecture key."""
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        raise ModelBuildError(f"{path}: no config.json; not an HF checkpoint directory")
    try:
        wrong = architecture_mismatches(json.loads(config_file.read_text()), model_cfg)
    except (HFConfigError, json.JSONDecodeError) as exc:
        raise ModelBuildError(f"{config_file}: {exc}") from exc
    if wrong:
        raise ModelBuildError(
            f"{path} does not match the model config ({'; '.join(wrong)}); fix model.* or the path"
        )


def load_model(path: str | Path, model_cfg: ModelConfig, *, dtype: torch.dtype = torch.float32) -> nn.Module:
    """Load an HF checkpoint (single-file, per-expert safetensors) into the fused transformers model.

    Names go through the layout's `fuse_experts`, the same map the weight sync uses; every tensor of
    the model must be in the file and nothing else may be. fp32 checkpoint tensors stay fp32.
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
    model.load_state_dict({name: t.to(own[name].dtype) for name, t in trainer_tensors.items()})
    return model


def write_hf_checkpoint(
    directory: str | Path, tensors: dict[str, torch.Tensor], model_cfg: ModelConfig
) -> Path:
    """Write `tensors` (HF names) as `model.safetensors` + `config.json` under `directory`.

    Crash-safe: each file is written to a temp name, fsynced and renamed; config.json goes last, so a
    directory with a config.json holds complete weights.
    """
    from safetensors.torch import save as safetensors_bytes

    config = checkpoint_config_json(model_cfg)  # refuses a model it cannot describe before writing
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    contiguous = {name: t.detach().contiguous() for name, t in tensors.items()}
    atomic_write_bytes(out / "model.safetensors", safetensors_bytes(contiguous, metadata={"format": "pt"}))
    atomic_write_json(out / "config.json", config)
    return out
