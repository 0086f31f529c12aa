"""Full Megatron tensors <-> HF tensors: `megatron_to_hf` (one tensor) and `hf_to_megatron` (a state dict).

Pure functions over names and tensors (no megatron-core import): the loader, the exporter and the
weight sync share them, so a name or a split exists in one place only.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import TYPE_CHECKING

from skyq.config.schema import ModelConfig
from skyq.trainer.megatron.mapping.tables import (
    EXPERT,
    HF_LAYER,
    LAYER,
    Entry,
    Kind,
    MappingError,
    check_model,
    hf_text_specs,
    layer_rules,
    table,
    top_rules,
)

if TYPE_CHECKING:
    from torch import Tensor

_WRAPPER = "module."
_LOCAL_EXPERT = re.compile(r"mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight")
_GROUPED_EXPERT = re.compile(r"mlp\.experts\.(linear_fc[12])\.weight(\d+)")


def strip_wrappers(name: str) -> str:
    """`module.module.decoder...` (DDP / Float16Module wrappers) -> `decoder...`."""
    while name.startswith(_WRAPPER):
        name = name[len(_WRAPPER) :]
    return name


def split_expert(rest: str) -> tuple[str, int] | None:
    """A layer-relative routed-expert name -> (its template with `{e}`, the expert index); else None."""
    m = _LOCAL_EXPERT.fullmatch(rest)
    if m is not None:
        return f"mlp.experts.local_experts.{EXPERT}.{m.group(2)}.weight", int(m.group(1))
    m = _GROUPED_EXPERT.fullmatch(rest)
    if m is not None:
        return f"mlp.experts.{m.group(1)}.weight{EXPERT}", int(m.group(2))
    return None


def parse(name: str, model_cfg: ModelConfig) -> Entry:
    """The table entry of a full-model Megatron name (either spec's; global expert index)."""
    check_model(model_cfg)
    name = strip_wrappers(name)
    p = model_cfg.text_prefix
    top = top_rules(model_cfg)
    if name in top:
        rule = top[name]
        return Entry(name, rule.kind, tuple(p + h for h in rule.hf), None, None)
    if name.startswith(LAYER):
        index, _, rest = name[len(LAYER) :].partition(".")
        if index.isdigit() and int(index) < model_cfg.num_layers:
            layer = int(index)
            rules = layer_rules(model_cfg, layer, None)
            expert = None
            template = rest
            split = split_expert(rest)
            if split is not None:
                template, expert = split
                if expert >= model_cfg.num_experts:
                    raise MappingError(
                        f"{name}: expert {expert} is outside model.num_experts={model_cfg.num_experts}"
                    )
            rule = rules.get(template)
            if rule is not None:
                hf_base = f"{p}{HF_LAYER}{layer}."
                hf = tuple(hf_base + h.replace(EXPERT, str(expert)) for h in rule.hf)
                return Entry(name, rule.kind, hf, layer, expert)
        elif index.isdigit():
            raise MappingError(f"{name}: layer {index} is outside model.num_layers={model_cfg.num_layers}")
    raise MappingError(
        f"{name}: not a Megatron tensor of a {model_cfg.family.value} model with this config "
        "(local or Transformer Engine spec names)"
    )


def _hf_shape(hf_name: str, model_cfg: ModelConfig) -> tuple[int, ...]:
    spec = hf_text_specs(model_cfg).get(hf_name)
    if spec is None:
        raise MappingError(f"{hf_name}: not a text-model tensor of the {model_cfg.family.value} layout")
    return tuple(spec.shape)


def megatron_shape(entry: Entry, model_cfg: ModelConfig) -> tuple[int, ...]:
    """The full Megatron tensor's shape, from its HF tensors' shapes in the layout."""
    shapes = [_hf_shape(h, model_cfg) for h in entry.hf]
    if entry.kind is Kind.copy:
        return shapes[0]
    return (sum(s[0] for s in shapes), *shapes[0][1:])


def _query_groups(model_cfg: ModelConfig) -> tuple[int, int, int]:
    groups, heads, d = model_cfg.num_key_value_heads, model_cfg.num_attention_heads, model_cfg.head_dim
    if heads % groups:
        raise MappingError(
            f"model.num_attention_heads={heads} is not a multiple of model.num_key_value_heads={groups}"
        )
    return groups, heads // groups, d


def merge(entry: Entry, tensors: list[Tensor], model_cfg: ModelConfig) -> Tensor:
    """The full Megatron tensor of `entry` from its HF tensors (in `entry.hf` order)."""
    import torch

    if entry.kind is Kind.copy:
        return tensors[0]
    if entry.kind is Kind.gate_up:
        return torch.cat(tensors, dim=0)
    groups, per_group, d = _query_groups(model_cfg)
    q, k, v = tensors
    cols = q.shape[1:]
    stacked = torch.cat(
        [
            q.reshape(groups, per_group, d, *cols),
            k.reshape(groups, 1, d, *cols),
            v.reshape(groups, 1, d, *cols),
        ],
        dim=1,
    )
    return stacked.reshape(groups * (per_group + 2) * d, *cols)


def split(entry: Entry, tensor: Tensor, model_cfg: ModelConfig) -> list[Tensor]:
    """The HF tensors of `entry` (in `entry.hf` order) from its full Megatron tensor."""
    if entry.kind is Kind.copy:
        return [tensor]
    if entry.kind is Kind.gate_up:
        return list(tensor.chunk(2, dim=0))
    groups, per_group, d = _query_groups(model_cfg)
    cols = tensor.shape[1:]
    grouped = tensor.reshape(groups, per_group + 2, d, *cols)
    return [
        grouped[:, :per_group].reshape(groups * per_group * d, *cols),
        grouped[:, per_group].reshape(groups * d, *cols),
        grouped[:, per_group + 1].reshape(groups * d, *cols),
    ]


def megatron_to_hf(name: str, tensor: Tensor, model_cfg: ModelConfig) -> list[tuple[str, Tensor]]:
    """The HF (name, tensor) pairs of one FULL Megatron tensor (unsharded; a routed expert by its
    global index). Accepts the local and the Transformer Engine spec names; a DDP / Float16Module
    `module.` prefix is ignored. The tensors are views of `tensor` where the split allows."""
    entry = parse(name, model_cfg)
    expected = megatron_shape(entry, model_cfg)
    if tuple(tensor.shape) != expected:
        raise MappingError(
            f"{name}: shape {tuple(tensor.shape)}, the model config needs {expected} (the full, "
            "unsharded tensor: gather TP shards first)"
        )
    return list(zip(entry.hf, split(entry, tensor, model_cfg)))


def check_hf_tensor(name: str, shape: tuple[int, ...], model_cfg: ModelConfig, where: str = "") -> None:
    """Refuse an HF tensor the model config has no place for, or one of the wrong shape."""
    at = f" (in {where})" if where else ""
    spec = hf_text_specs(model_cfg).get(name)
    if spec is None:
        raise MappingError(
            f"{name}{at}: not a tensor of the {model_cfg.family.value} text model this config describes "
            f"(num_layers={model_cfg.num_layers}, num_experts={model_cfg.num_experts}, "
            f"text_prefix={model_cfg.text_prefix!r}); check model.* against the checkpoint's config.json"
        )
    if tuple(shape) != tuple(spec.shape):
        raise MappingError(f"{name}{at}: shape {tuple(shape)}, the model config needs {tuple(spec.shape)}")


def hf_to_megatron(hf: Mapping[str, Tensor], model_cfg: ModelConfig, spec: str) -> dict[str, Tensor]:
    """Full Megatron tensors (global expert indices, names of `spec`: "local" or "te") from an HF
    state dict holding exactly the text model. An HF name with no place (or the wrong shape) is
    refused; Megatron tensors left unfilled are named in the error."""
    entries = table(model_cfg, spec)
    for name, tensor in hf.items():
        check_hf_tensor(name, tuple(tensor.shape), model_cfg)
    out: dict[str, Tensor] = {}
    unfilled: list[str] = []
    for entry in entries:
        missing = [h for h in entry.hf if h not in hf]
        if missing:
            unfilled.append(f"{entry.megatron} (needs {', '.join(missing)})")
            continue
        out[entry.megatron] = merge(entry, [hf[h] for h in entry.hf], model_cfg)
    if unfilled:
        shown = "; ".join(unfilled[:4]) + (f"; and {len(unfilled) - 4} more" if len(unfilled) > 4 else "")
        raise MappingError(f"HF state dict leaves {len(unfilled)} Megatron tensor(s) unfilled: {shown}")
    return out
