"""Tensor- and expert-parallel slicing of full Megatron tensors, and its inverse, following megatron-core.

Megatron-core partitions (`tensor_parallel/layers.py`, Transformer Engine's linears alike):
- dim 0 (ColumnParallelLinear, VocabParallelEmbedding): the embedding, the output layer,
  `linear_qkv` (contiguous rows = whole query groups), MLA's `linear_q_proj` / `linear_q_up_proj` /
  `linear_kv_up_proj` (whole heads), every `linear_fc1`;
- dim 1 (RowParallelLinear): `linear_proj`, every `linear_fc2`;
- replicated: norms (also under sequence parallelism), the router and its `expert_bias`.
A gated `linear_fc1` holds [gate; up], and each rank holds [gate_r; up_r] (SwiGLU), not a
contiguous block of the full tensor. MLA's down projections (`linear_q_down_proj`,
`linear_kv_down_proj`) are replicated: a `TELinear(parallel_mode="duplicated")` in the Transformer
Engine spec, skyq's `ReplicatedLinear` in its local spec (megatron-core's stock local spec splits them
by rows, which leaves the rotary-key gradient unreduced across TP; `io` follows a module's own
`tensor_model_parallel` attribute, so even that spec loads and exports correctly).
Routed experts are split across the expert-parallel group (EP rank r holds the global experts
[r*E/ep, (r+1)*E/ep), as its local experts 0..E/ep-1) and each expert across the expert tensor-parallel
group (ETP), with the same dims as above.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from skyq.config.schema import ModelConfig
from skyq.trainer.megatron.mapping.convert import parse, split_expert, strip_wrappers
from skyq.trainer.megatron.mapping.tables import LAYER, MappingError

if TYPE_CHECKING:
    from torch import Tensor

_DIM0 = ("linear_qkv.weight", "linear_q_proj.weight", "linear_q_up_proj.weight", "linear_kv_up_proj.weight")


@dataclass(frozen=True, slots=True)
class Partition:
    """How one Megatron tensor is split across its tensor-parallel group."""

    dim: int | None
    """The partitioned dim; None = replicated."""
    gated: bool
    """A gated `linear_fc1`: each rank holds [gate_r; up_r]."""
    expert: int | None
    """The global routed-expert index (split across EP, then ETP), None for any other tensor."""


def partition(name: str, model_cfg: ModelConfig) -> Partition:
    """How skyq's Megatron models (either spec) split the full-model tensor `name`."""
    entry = parse(name, model_cfg)
    name = entry.megatron
    leaf = name
    if entry.layer is not None:
        leaf = name[len(f"{LAYER}{entry.layer}.") :]
        expert = split_expert(leaf)
        if expert is not None:
            leaf = expert[0].replace(".weight{e}", ".weight").replace("local_experts.{e}.", "")
    if name in ("embedding.word_embeddings.weight", "output_layer.weight") or leaf.endswith(_DIM0):
        return Partition(0, False, entry.expert)
    if leaf.endswith("linear_fc1.weight"):
        return Partition(0, True, entry.expert)
    if leaf.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return Partition(1, False, entry.expert)
    return Partition(None, False, entry.expert)


def tp_slice(full: Tensor, dim: int | None, gated: bool, rank: int, size: int, name: str) -> Tensor:
    """Rank `rank`'s piece of `full` in a group of `size` (a view where possible)."""
    import torch

    if dim is None or size == 1:
        return full
    if gated:
        gate, up = full.chunk(2, dim=0)
        return torch.cat(
            [tp_slice(gate, 0, False, rank, size, name), tp_slice(up, 0, False, rank, size, name)]
        )
    if full.shape[dim] % size:
        raise MappingError(
            f"{name}: dim {dim} of shape {tuple(full.shape)} does not split into {size} tensor-parallel "
            "pieces; choose a TP/ETP size that divides it"
        )
    return full.chunk(size, dim=dim)[rank]


def tp_merge(pieces: list[Tensor], dim: int | None, gated: bool) -> Tensor:
    """The full tensor from every rank's piece (in rank order): the inverse of `tp_slice`."""
    import torch

    if dim is None or len(pieces) == 1:
        return pieces[0]
    if gated:
        halves = [p.chunk(2, dim=0) for p in pieces]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(pieces, dim=dim)


def experts_per_rank(model_cfg: ModelConfig, ep_size: int) -> int:
    if model_cfg.num_experts % ep_size:
        raise MappingError(
            f"model.num_experts={model_cfg.num_experts} does not split over expert-parallel size {ep_size}; "
            "topology.parallel.ep must divide it"
        )
    return model_cfg.num_experts // ep_size


def _renumber(name: str, old: int, new: int) -> str:
    """Replace the expert index `old` of a routed-expert name by `new`."""
    local = f".local_experts.{old}."
    if local in name:
        return name.replace(local, f".local_experts.{new}.")
    head, sep, tail = name.rpartition(f".weight{old}")
    if not sep or tail:
        raise MappingError(f"{name}: not a routed-expert name with index {old}")
    return f"{head}.weight{new}"


def global_name(local: str, model_cfg: ModelConfig, ep_rank: int, ep_size: int) -> str:
    """A model's own (EP-local) tensor name -> the full-model name (global expert index)."""
    local = strip_wrappers(local)
    layer, _, rest = local.removeprefix(LAYER).partition(".")
    parsed = split_expert(rest) if local.startswith(LAYER) else None
    if parsed is None:
        return local
    index = parsed[1]
    per_rank = experts_per_rank(model_cfg, ep_size)
    if index >= per_rank:
        raise MappingError(f"{local}: local expert {index} is outside the {per_rank} experts of an EP rank")
    return _renumber(local, index, ep_rank * per_rank + index)


def local_name(name: str, model_cfg: ModelConfig, ep_rank: int, ep_size: int) -> str | None:
    """A full-model name -> the name on EP rank `ep_rank`; None if that rank does not hold it."""
    entry = parse(name, model_cfg)
    if entry.expert is None:
        return entry.megatron
    per_rank = experts_per_rank(model_cfg, ep_size)
    if entry.expert // per_rank != ep_rank:
        return None
    return _renumber(entry.megatron, entry.expert, entry.expert % per_rank)


def shard(
    name: str,
    full: Tensor,
    model_cfg: ModelConfig,
    *,
    tp_rank: int,
    tp_size: int,
    ep_rank: int,
    ep_size: int,
    etp_rank: int = 0,
    etp_size: int = 1,
) -> Tensor | None:
    """This rank's piece of the FULL Megatron tensor `name` (global expert index), or None when the
    rank does not hold it (a routed expert of another EP rank). Routed experts split across ETP,
    everything else across TP."""
    part = partition(name, model_cfg)
    if part.expert is None:
        return tp_slice(full, part.dim, part.gated, tp_rank, tp_size, name)
    if part.expert // experts_per_rank(model_cfg, ep_size) != ep_rank:
        return None
    return tp_slice(full, part.dim, part.gated, etp_rank, etp_size, name)


def unshard(name: str, pieces: list[Tensor], model_cfg: ModelConfig) -> Tensor:
    """The full tensor `name` from its TP (ETP for a routed expert) pieces in rank order."""
    part = partition(name, model_cfg)
    return tp_merge(pieces, part.dim, part.gated)
