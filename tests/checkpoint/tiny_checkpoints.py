"""Tiny real HF checkpoints for the checkpoint and converter tests (no fixtures, plain functions).

`write_sharded` lays tensors out over several small shards with an index, the way HF does, with an
optional `place` hook so a test can force a scale into another shard than its weight.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file

INDEX = "model.safetensors.index.json"


def write_sharded(
    tensors: dict[str, torch.Tensor],
    directory: Path,
    *,
    max_shard_bytes: int = 64 * 1024,
    place: Callable[[str], str | None] | None = None,
    config: dict | None = None,
) -> list[str]:
    """Save `tensors` as `model-0000i-of-0000n.safetensors` shards + index (+ config.json).

    Tensors are packed in name order until a shard exceeds `max_shard_bytes`; `place(name)` may
    instead return a group key to pin a tensor into a dedicated shard (e.g. "scales").
    """
    directory.mkdir(parents=True, exist_ok=True)
    groups: list[list[str]] = [[]]
    pinned: dict[str, list[str]] = {}
    size = 0
    for name in sorted(tensors):
        key = place(name) if place else None
        if key is not None:
            pinned.setdefault(key, []).append(name)
            continue
        nbytes = tensors[name].numel() * tensors[name].element_size()
        if groups[-1] and size + nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    groups = [g for g in groups if g] + [pinned[k] for k in sorted(pinned)]
    shard_names = [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    weight_map, total = {}, 0
    for shard, names in zip(shard_names, groups):
        save_file(
            {n: tensors[n].contiguous() for n in names}, str(directory / shard), metadata={"format": "pt"}
        )
        for n in names:
            weight_map[n] = shard
            total += tensors[n].numel() * tensors[n].element_size()
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (directory / INDEX).write_text(json.dumps(index, indent=2))
    if config is not None:
        (directory / "config.json").write_text(json.dumps(config, indent=2))
    return shard_names


def load_all(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint directory, by name."""
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for path in sorted(directory.glob("*.safetensors")):
        out.update(load_file(str(path)))
    return out


def dir_bytes(directory: Path) -> dict[str, bytes]:
    """Relative path -> bytes of every file under `directory` (for byte-identity comparisons)."""
    return {
        str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()
    }


# ---- tiny models ----------------------------------------------------------------------------------

TOKENIZER_FILES = {
    "tokenizer_config.json": '{"model_max_length": 64, "tokenizer_class": "PreTrainedTokenizerFast"}\n',
    "special_tokens_map.json": '{"eos_token": "<eos>"}\n',
}


def _save_with_transformers(model, directory: Path) -> dict[str, torch.Tensor]:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        tensors = load_all(Path(tmp))
        config = json.loads((Path(tmp) / "config.json").read_text())
        generation = (Path(tmp) / "generation_config.json").read_text()
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "generation_config.json").write_text(generation)
    for name, text in TOKENIZER_FILES.items():
        (directory / name).write_text(text)
    return tensors, config


def qwen3_moe_hf_config() -> dict:
    """Dims are multiples of 128 so transformers' FP8 loader (which infers the block from the scale
    grid) can serve as an oracle for our blockwise output."""
    return dict(
        vocab_size=256, hidden_size=128, intermediate_size=256, moe_intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=64, num_experts=4, num_experts_per_tok=2,
        max_position_embeddings=64, tie_word_embeddings=False,
    )  # fmt: skip


def make_qwen3_moe(directory: Path, *, seed: int = 0, max_shard_bytes: int = 48 * 1024) -> list[str]:
    """A tiny random Qwen3-MoE saved by transformers 5, resharded into many small shards."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**qwen3_moe_hf_config())).to(torch.bfloat16)
    tensors, config = _save_with_transformers(model, directory)
    return write_sharded(tensors, directory, max_shard_bytes=max_shard_bytes, config=config)


VISION = {
    "vt_num_hidden_layers": 1,
    "vt_hidden_size": 64,
    "vt_intermediate_size": 128,
    "vt_num_attention_heads": 2,
}


def make_kimi_like(directory: Path, *, seed: int = 0, max_shard_bytes: int = 96 * 1024) -> list[str]:
    """A tiny Kimi-K2.6-like checkpoint: a DeepSeek-V3 text model (MLA, dense layer 0, routed +
    shared experts) under `language_model.`, a MoonViT-style `vision_tower` and an `mm_projector`,
    with the text config nested under `text_config`."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    from skyq.checkpoint.hf_config import model_config_from_hf
    from skyq.quant.layouts import vision

    torch.manual_seed(seed)
    text = DeepseekV3Config(
        vocab_size=256, hidden_size=128, intermediate_size=256, moe_intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
        first_k_dense_replace=1, q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=32,
        v_head_dim=32, n_group=1, topk_group=1, max_position_embeddings=64, num_nextn_predict_layers=0,
    )  # fmt: skip
    model = DeepseekV3ForCausalLM(text).to(torch.bfloat16)
    text_tensors, text_config = _save_with_transformers(model, directory)
    config = {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "model_type": "kimi_k25",
        "text_config": text_config,
        "vision_config": dict(VISION, patch_size=14, mm_hidden_size=64),
    }
    tensors = {"language_model." + k: v for k, v in text_tensors.items()}
    g = torch.Generator().manual_seed(seed + 1)
    for name, shape in vision.vision_parameters(model_config_from_hf(config)):
        tensors[name] = (torch.randn(shape, generator=g) * 0.02).bfloat16()
    return write_sharded(tensors, directory, max_shard_bytes=max_shard_bytes, config=config)


def reshard(
    src: Path, dst: Path, *, max_shard_bytes: int, place: Callable[[str], str | None] | None = None
) -> list[str]:
    """Copy a checkpoint into new small shards (e.g. every scale pinned apart from its weight)."""
    import shutil

    dst.mkdir(parents=True, exist_ok=True)
    for p in src.iterdir():
        if p.suffix != ".safetensors" and p.name not in (INDEX, "skyq_manifest.json") and p.is_file():
            shutil.copyfile(p, dst / p.name)
    return write_sharded(load_all(src), dst, max_shard_bytes=max_shard_bytes, place=place)


def scales_apart(name: str) -> str | None:
    """`place` hook: every quantization side tensor goes to a shard of its own group."""
    return (
        "zz-scales" if name.endswith(("_scale", "_scale_inv", "weight_shape", "weight_zero_point")) else None
    )


def make_synthetic_qwen3_moe(
    directory: Path, *, seed: int = 0, max_shard_bytes: int = 256 * 1024
) -> list[str]:
    """A Qwen3-MoE checkpoint built from skyq's layout alone (no transformers: runs on a GPU box
    that lacks it). Dims are multiples of 128 so the GPU kernels, not their fallbacks, run; row
    magnitudes spread over six decades, one expert weight is all zeros and one holds subnormals."""
    from skyq.checkpoint.hf_config import model_config_from_hf
    from skyq.quant.layouts import get_layout

    config = {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "rms_norm_eps": 1e-6,
        "torch_dtype": "bfloat16", **qwen3_moe_hf_config(),
        "hidden_size": 256, "intermediate_size": 384, "num_attention_heads": 4, "num_key_value_heads": 2,
    }  # fmt: skip
    cfg = model_config_from_hf(config)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for spec in get_layout(cfg.family).hf_parameters(cfg):
        t = torch.randn(spec.shape, generator=g)
        if t.ndim == 2:
            t = t * 10.0 ** (torch.rand((t.shape[0], 1), generator=g) * 6 - 4)
        tensors[spec.name] = (t * 0.02).to(spec.dtype)
    experts = sorted(n for n in tensors if ".experts." in n and n.endswith("down_proj.weight"))
    tensors[experts[0]].zero_()
    tensors[experts[1]][:5] = torch.randn(tensors[experts[1]][:5].shape, generator=g).mul(1e-39).bfloat16()
    return write_sharded(tensors, directory, max_shard_bytes=max_shard_bytes, config=config)
