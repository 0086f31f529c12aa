"""Load a HF safetensors checkpoint into a Megatron model's shards, and export its weights to HF names.

Both read the ranks and groups from megatron-core's `parallel_state` (tensor, expert and expert
tensor parallel; data-parallel ranks hold the same shards and load or export alike). Pipeline
parallelism is refused for now: each stage would hold and export only its own layers.

How each parameter is split comes from the module itself where it says: megatron-core's and
Transformer Engine's linears and embeddings (and skyq's `ReplicatedLinear`) mark their weights with
`tensor_model_parallel` / `partition_dim`, so a spec that splits or replicates a weight differently
from skyq's (megatron-core's stock local MLA down projections) still loads and exports correctly; the
name table (`sharding.partition`) covers weights without the marks (norms, router). A piece whose
shape is not the parameter's is an error either way.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from skyq.config.schema import ModelConfig
from skyq.quant.layouts import get_layout
from skyq.quant.layouts.experts import parse_expert_name
from skyq.trainer.megatron.mapping.convert import (
    check_hf_tensor,
    megatron_shape,
    megatron_to_hf,
    merge,
    parse,
    split_expert,
    strip_wrappers,
)
from skyq.trainer.megatron.mapping.sharding import (
    experts_per_rank,
    global_name,
    partition,
    tp_merge,
    tp_slice,
)
from skyq.trainer.megatron.mapping.tables import (
    LAYER,
    MappingError,
    check_spec,
    hf_text_specs,
    layer_rules,
    megatron_names,
)

if TYPE_CHECKING:
    import torch
    from torch import Tensor

_EXTRA_STATE = "._extra_state"
_SHARED = "mlp.shared_experts."


def model_tensors(model: torch.nn.Module) -> dict[str, Tensor]:
    """The model's own weights by name (wrapper prefixes removed): parameters and persistent buffers
    (the router's `expert_bias`), without Transformer Engine's `_extra_state` entries."""
    out: dict[str, Tensor] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if tensor is None or name.endswith(_EXTRA_STATE):
            continue
        out[strip_wrappers(name)] = tensor
    return out


class _Ranks:
    """This process's tensor / expert / expert-tensor parallel ranks, sizes and groups."""

    def __init__(self) -> None:
        from megatron.core import parallel_state as ps

        if ps.get_pipeline_model_parallel_world_size() > 1:
            raise MappingError(
                f"pipeline parallel size {ps.get_pipeline_model_parallel_world_size()}: the HF <-> "
                "Megatron load and export support pp=1 only for now; set topology.parallel.pp=1"
            )
        self.tp_rank, self.tp_size = (
            ps.get_tensor_model_parallel_rank(),
            ps.get_tensor_model_parallel_world_size(),
        )
        self.ep_rank, self.ep_size = (
            ps.get_expert_model_parallel_rank(),
            ps.get_expert_model_parallel_world_size(),
        )
        self.etp_rank = ps.get_expert_tensor_parallel_rank()
        self.etp_size = ps.get_expert_tensor_parallel_world_size()
        self.tp_group = ps.get_tensor_model_parallel_group() if self.tp_size > 1 else None
        self.ep_group = ps.get_expert_model_parallel_group() if self.ep_size > 1 else None
        self.etp_group = ps.get_expert_tensor_parallel_group() if self.etp_size > 1 else None


def _split_dim(tensor: Tensor, name: str, model_cfg: ModelConfig) -> tuple[int | None, bool]:
    """(partitioned dim or None, gated fc1) of a model tensor: megatron's own attributes first."""
    part = partition(name, model_cfg)
    if hasattr(tensor, "tensor_model_parallel"):
        dim = tensor.partition_dim if tensor.tensor_model_parallel else None
        return dim, part.gated and dim == 0
    return part.dim, part.gated


class _HFReader:
    """Tensors of a verified checkpoint, one open handle per shard file."""

    def __init__(self, hf_dir: str | Path) -> None:
        from skyq.checkpoint.reader import ShardedCheckpoint

        self.ckpt = ShardedCheckpoint(hf_dir)
        self._handles: dict[str, object] = {}

    def where(self, name: str) -> str:
        return str(self.ckpt.dir / self.ckpt.tensors[name].shard)

    def get(self, name: str) -> Tensor:
        from safetensors import safe_open

        shard = self.ckpt.tensors[name].shard
        if shard not in self._handles:
            self._handles[shard] = safe_open(str(self.ckpt.dir / shard), framework="pt")
        return self._handles[shard].get_tensor(name)


def _check_spec_names(tensors: dict[str, Tensor], model_cfg: ModelConfig, spec: str, ranks: _Ranks) -> None:
    """Refuse a model whose tensor names are not those of `spec`'s table (or not of this config)."""
    known = set(megatron_names(model_cfg, spec))
    for local in tensors:
        name = global_name(local, model_cfg, ranks.ep_rank, ranks.ep_size)
        if name not in known:
            parse(name, model_cfg)  # the clearer error for a name of no spec at all
            raise MappingError(
                f"model tensor {local}: a name the spec={spec!r} table does not have; pass the spec "
                "the model was built with (local on the CPU, te with Transformer Engine)"
            )


def _expert_of(hf_name: str, model_cfg: ModelConfig) -> int | None:
    parsed = parse_expert_name(hf_name.removeprefix(model_cfg.text_prefix))
    return None if parsed is None else parsed[1]


def load_hf_checkpoint(model: torch.nn.Module, hf_dir: str | Path, model_cfg: ModelConfig, spec: str) -> None:
    """Copy this rank's shard of every tensor of the HF checkpoint in `hf_dir` into `model`.

    Every checkpoint tensor of the text model is checked (name and shape, naming its file) before
    anything is copied; tensors outside the text model (a vision tower) are not loaded. Each model
    parameter (and the router's `expert_bias`) is filled exactly once (the model's names are unique
    and `_check_spec_names` admits only names of the spec's table, one entry each), and every
    checkpoint tensor this rank holds a piece of must be used: either failing is an error naming the
    tensor, raised before any parameter is written.
    """
    import torch

    check_spec(spec)
    reader = _HFReader(hf_dir)
    layout = get_layout(model_cfg.family)
    text_names = [n for n in reader.ckpt.tensors if layout.is_text_name(n, model_cfg)]
    for name in text_names:
        check_hf_tensor(name, reader.ckpt.tensors[name].shape, model_cfg, where=reader.where(name))
    ranks = _Ranks()
    tensors = model_tensors(model)
    _check_spec_names(tensors, model_cfg, spec, ranks)
    # names and shapes only, before the first copy: a refused checkpoint leaves the model untouched
    plan = []
    used: set[str] = set()
    for local, target in tensors.items():
        name = global_name(local, model_cfg, ranks.ep_rank, ranks.ep_size)
        entry = parse(name, model_cfg)
        missing = [h for h in entry.hf if h not in reader.ckpt.tensors]
        if missing:
            raise MappingError(
                f"{reader.ckpt.dir}: no tensor {missing[0]!r}, needed for model tensor {local}"
            )
        dim, gated = _split_dim(target, name, model_cfg)
        rank, size = (
            (ranks.etp_rank, ranks.etp_size) if entry.expert is not None else (ranks.tp_rank, ranks.tp_size)
        )
        piece_shape = list(megatron_shape(entry, model_cfg))
        if dim is not None:
            if piece_shape[dim] % size:
                raise MappingError(
                    f"model tensor {local}: dim {dim} of the full shape {tuple(piece_shape)} does not "
                    f"split into {size} tensor-parallel pieces; choose a TP/ETP size that divides it"
                )
            piece_shape[dim] //= size
        if tuple(piece_shape) != tuple(target.shape):
            raise MappingError(
                f"model tensor {local}: shape {tuple(target.shape)}, but the checkpoint's "
                f"{', '.join(entry.hf)} give a piece of {tuple(piece_shape)} on rank {rank} of {size}"
            )
        plan.append((entry, target, dim, gated, rank, size))
        used.update(entry.hf)
    per_rank = experts_per_rank(model_cfg, ranks.ep_size)
    unused = [
        n
        for n in text_names
        if n not in used
        and (_expert_of(n, model_cfg) is None or _expert_of(n, model_cfg) // per_rank == ranks.ep_rank)
    ]
    if unused:
        raise MappingError(
            f"{reader.where(unused[0])}: tensor {unused[0]!r} (and {len(unused) - 1} more) has no "
            f"tensor to go to in this Megatron model (spec={spec}); the model and model.* disagree"
        )
    with torch.no_grad():
        for entry, target, dim, gated, rank, size in plan:
            full = merge(entry, [reader.get(h) for h in entry.hf], model_cfg)
            target.copy_(tp_slice(full, dim, gated, rank, size, entry.megatron))


def _gather(tensor: Tensor, group, size: int) -> list[Tensor]:
    import torch
    import torch.distributed as dist

    if size == 1:
        return [tensor]
    pieces = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(pieces, tensor.contiguous(), group=group)
    return pieces


def _layer_of(name: str) -> int | None:
    if not name.startswith(LAYER):
        return None
    return int(name[len(LAYER) :].partition(".")[0])


def _hf_cast(pairs: list[tuple[str, Tensor]], model_cfg: ModelConfig) -> Iterator[tuple[str, Tensor]]:
    specs = hf_text_specs(model_cfg)
    for hf_name, tensor in pairs:
        yield hf_name, tensor.to(specs[hf_name].dtype)


def export_hf(model: torch.nn.Module, model_cfg: ModelConfig, spec: str) -> Iterator[tuple[str, Tensor]]:
    """(HF name, full tensor) for every weight of `model`, on EVERY rank: a collective that each rank
    of the tensor- and expert-parallel groups must iterate to the end, in step.

    TP (and ETP) pieces are all-gathered and merged, routed experts all-gathered across EP one local
    index at a time (ep experts in memory at once). The order is deterministic and grouped by decoder
    layer: the embedding, then per layer its attention, norms, router and dense or shared MLP, then
    its routed experts (gate, up, down of each), local index i on every EP rank before i + 1 (so
    experts i, E/ep + i, ...; ascending when ep = 1), then its shared experts; then the final norm
    and lm_head. With ep = 1 that is exactly the layout's `hf_parameters` order. Tensors come in the HF checkpoint dtypes (bf16; fp32
    `e_score_correction_bias`); a replicated tensor already in that dtype is the model's own storage
    (detached, not copied), so consume or copy each before the next optimizer step. The model's
    tensor names must be those of `spec` (checked before the first collective).
    """

    check_spec(spec)
    ranks = _Ranks()
    per_rank = experts_per_rank(model_cfg, ranks.ep_size)
    tensors = model_tensors(model)
    by_layer: dict[int | None, list[str]] = {}
    for local in tensors:
        by_layer.setdefault(_layer_of(local), []).append(local)

    def full_of(local: str, expert: bool) -> Tensor:
        target = tensors[local].detach()
        name = global_name(local, model_cfg, ranks.ep_rank, ranks.ep_size)
        dim, gated = _split_dim(tensors[local], name, model_cfg)
        if dim is None:
            return target
        group, size = (ranks.etp_group, ranks.etp_size) if expert else (ranks.tp_group, ranks.tp_size)
        return tp_merge(_gather(target, group, size), dim, gated)

    _check_spec_names(tensors, model_cfg, spec, ranks)  # before the first collective, not halfway
    top = by_layer.get(None, [])
    for local in (n for n in top if n == "embedding.word_embeddings.weight"):
        yield from _hf_cast(megatron_to_hf(local, full_of(local, False), model_cfg), model_cfg)
    for layer in range(model_cfg.num_layers):
        names = by_layer.get(layer, [])
        rest = {n[len(f"{LAYER}{layer}.") :]: n for n in names}
        order = list(layer_rules(model_cfg, layer, None))
        plain = sorted(
            (r for r in rest if split_expert(r) is None), key=lambda r: _position(r, order, rest[r])
        )
        for r in (r for r in plain if not r.startswith(_SHARED)):
            yield from _hf_cast(megatron_to_hf(rest[r], full_of(rest[r], False), model_cfg), model_cfg)
        templates: dict[str, dict[int, str]] = {}
        for r in rest:
            parsed = split_expert(r)
            if parsed is not None:
                templates.setdefault(parsed[0], {})[parsed[1]] = rest[r]
        ordered = sorted(templates, key=lambda t: _position(t, order, t))
        for template in ordered:
            if sorted(templates[template]) != list(range(per_rank)):
                raise MappingError(
                    f"decoder layer {layer}: this rank holds local experts {sorted(templates[template])} "
                    f"of {template}, expected 0..{per_rank - 1}"
                )
        # one local expert index at a time: ep experts in memory, not the layer's whole stack
        for i in range(per_rank):
            gathered = {
                t: _gather(full_of(templates[t][i], True), ranks.ep_group, ranks.ep_size) for t in ordered
            }
            for r in range(ranks.ep_size):
                for t in ordered:
                    name = f"{LAYER}{layer}." + t.replace("{e}", str(r * per_rank + i))
                    yield from _hf_cast(megatron_to_hf(name, gathered[t][r], model_cfg), model_cfg)
        for r in (r for r in plain if r.startswith(_SHARED)):
            yield from _hf_cast(megatron_to_hf(rest[r], full_of(rest[r], False), model_cfg), model_cfg)
    for name in ("decoder.final_layernorm.weight", "output_layer.weight"):
        if name in top:
            yield from _hf_cast(megatron_to_hf(name, full_of(name, False), model_cfg), model_cfg)


def _position(rest: str, order: list[str], name: str) -> int:
    if rest not in order:
        raise MappingError(f"model tensor {name}: not a Megatron tensor of this model config's layer")
    return order.index(rest)
