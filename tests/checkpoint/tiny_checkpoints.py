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
