"""Load a HF safetensors checkpoint into a Megatron model's shards, and export its weights to HF names.

Both read the ranks and groups from megatron-core's `parallel_state` (tensor, pipeline, expert and
expert tensor parallel; data-parallel ranks hold the same shards and load or export alike).

Pipeline parallelism: a stage holds the embedding (first stage), a contiguous run of decoder layers
and the final norm and output layer (last stage). Megatron numbers a stage's layers from 0
(`decoder.layers.0` is global layer `offset`); `model_tensors` names them by their global index
(from the layers' own `layer_number`), so the tables, the load and the export see full-model names
on every stage. With tied embeddings the last stage holds its own copy of the embedding as
`output_layer.weight` (megatron-core keeps the two equal by summing their gradients across the
embedding group): it is loaded from `embed_tokens` and not exported (the first stage exports it).
The export is gathered across the pipeline stage by stage (`_pipeline_export`), so every rank gets
the full model in the same order as at pp = 1.

How each parameter is split comes from the module itself where it says: megatron-core's and
Transformer Engine's linears and embeddings (and skyq's `ReplicatedLinear`) mark their weights with
`tensor_model_parallel` / `partition_dim`, so a spec that splits or replicates a weight differently
from skyq's (megatron-core's stock local MLA down projections) still loads and exports correctly; the
name table (`sharding.partition`) covers weights without the marks (norms, router). A piece whose
shape is not the parameter's is an error either way.
"""

from __future__ import annotations

import re
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
    table,
)

if TYPE_CHECKING:
    import torch
    from torch import Tensor

_EXTRA_STATE = "._extra_state"
_SHARED = "mlp.shared_experts."
_EMBEDDING = "embedding.word_embeddings.weight"
_OUTPUT = "output_layer.weight"
_LOCAL_LAYER = re.compile(rf"^{re.escape(LAYER)}(\d+)\.")


def layer_offset(model: torch.nn.Module) -> int:
    """The global index of the model's first decoder layer: 0 unless it is a later pipeline stage
    (megatron-core's `TransformerLayer.layer_number` is global and 1-based)."""
    numbers = [m.layer_number for m in model.modules() if _is_transformer_layer(m)]
    return min(numbers) - 1 if numbers else 0


def _is_transformer_layer(module: torch.nn.Module) -> bool:
    from megatron.core.transformer.transformer_layer import TransformerLayer

    return isinstance(module, TransformerLayer)


def model_tensors(model: torch.nn.Module) -> dict[str, Tensor]:
    """The model's own weights by name (wrapper prefixes removed, decoder layers by their global
    index): parameters and persistent buffers (the router's `expert_bias`), without Transformer
    Engine's `_extra_state` entries."""
    offset = layer_offset(model)
    out: dict[str, Tensor] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if tensor is None or name.endswith(_EXTRA_STATE):
            continue
        name = strip_wrappers(name)
        if offset:
            name = _LOCAL_LAYER.sub(lambda m: f"{LAYER}{int(m.group(1)) + offset}.", name, count=1)
        out[name] = tensor
    return out


def _tied_copy(name: str, model_cfg: ModelConfig) -> bool:
    """The last pipeline stage's copy of a tied embedding (see the module docstring)."""
    return model_cfg.tie_word_embeddings and name == _OUTPUT


class _Ranks:
    """This process's tensor / expert / expert-tensor parallel ranks, sizes and groups."""

    def __init__(self) -> None:
        from megatron.core import parallel_state as ps

        self.pp_rank = ps.get_pipeline_model_parallel_rank()
        self.pp_size = ps.get_pipeline_model_parallel_world_size()
        self.pp_group = ps.get_pipeline_model_parallel_group() if self.pp_size > 1 else None
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
        if name not in known and not _tied_copy(name, model_cfg):
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
        entry = parse(_EMBEDDING if _tied_copy(name, model_cfg) else name, model_cfg)
        missing = [h for h in entry.hf if h not in reader.ckpt.tensors]
        if missing:
            raise MappingError(
                f"{reader.ckpt.dir}: no tensor {missing[0]!r}, needed for model tensor {local}"
            )
        dim, gated = _split_dim(target, entry.megatron, model_cfg)
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
    stage = _stage_hf_names(tensors, model_cfg, spec) if ranks.pp_size > 1 else None
    unused = [
        n
        for n in text_names
        if n not in used
        and (stage is None or n in stage)
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


def _stage_hf_names(tensors: dict[str, Tensor], model_cfg: ModelConfig, spec: str) -> set[str]:
    """The HF tensors this pipeline stage's part of the model is made from, and any HF name of
    no Megatron tensor at all (so an unplaceable checkpoint tensor is refused on every stage)."""
    layers = {_layer_of(n) for n in tensors} - {None}
    top = {n for n in tensors if _layer_of(n) is None}
    placed: set[str] = set()
    stage: set[str] = set()
    for entry in table(model_cfg, spec):
        placed.update(entry.hf)
        if (entry.layer in layers) if entry.layer is not None else (entry.megatron in top):
            stage.update(entry.hf)
    return stage | (set(hf_text_specs(model_cfg)) - placed)


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
    """(HF name, full tensor) for every weight of the whole model, on EVERY rank: a collective that
    every rank of the world's tensor-, expert- and pipeline-parallel groups must iterate to the end,
    in step.

    TP (and ETP) pieces are all-gathered and merged, routed experts all-gathered across EP one local
    index at a time (ep experts in memory at once). The order is deterministic and grouped by decoder
    layer: the embedding, then per layer its attention, norms, router and dense or shared MLP, then
    its routed experts (gate, up, down of each), local index i on every EP rank before i + 1 (so
    experts i, E/ep + i, ...; ascending when ep = 1), then its shared experts; then the final norm
    and lm_head. With ep = 1 that is exactly the layout's `hf_parameters` order. Tensors come in the HF checkpoint dtypes (bf16; fp32
    `e_score_correction_bias`); a replicated tensor already in that dtype is the model's own storage
    (detached, not copied), so consume or copy each before the next optimizer step. The model's
    tensor names must be those of `spec` (checked before the first collective). Under pipeline
    parallelism each stage's tensors are gathered within the stage and then broadcast to the other
    stages, stage after stage (`_pipeline_export`); tensors another stage sent are fresh copies.
    """

    check_spec(spec)
    ranks = _Ranks()
    stage = _stage_export(model, model_cfg, spec, ranks)
    if ranks.pp_size == 1:
        yield from stage
    else:
        yield from _pipeline_export(stage, ranks)


def _stage_export(
    model: torch.nn.Module, model_cfg: ModelConfig, spec: str, ranks: _Ranks
) -> Iterator[tuple[str, Tensor]]:
    """`export_hf` of this pipeline stage's tensors (all of them at pp = 1)."""
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
    for local in (n for n in top if n == _EMBEDDING):
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
    for name in ("decoder.final_layernorm.weight", _OUTPUT):
        if name in top and not _tied_copy(name, model_cfg):
            yield from _hf_cast(megatron_to_hf(name, full_of(name, False), model_cfg), model_cfg)


_WIRE_DTYPES = (
    "bfloat16", "float32", "float16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool",
    "float8_e4m3fn", "float8_e5m2",
)  # fmt: skip
_MAX_DIMS = 8
_END = -1


def _pipeline_export(stage: Iterator[tuple[str, Tensor]], ranks: _Ranks) -> Iterator[tuple[str, Tensor]]:
    """Every stage's (HF name, tensor) pairs on every rank of the pipeline group, stage 0's first.

    Stage s's ranks run their own export (its TP / EP collectives) while broadcasting each pair
    over the pipeline group: a header (name length, dtype, shape), the UTF-8 name, the tensor's raw
    bytes (bit for bit, whatever the dtype), then an end marker; the other stages receive and yield
    the same pairs. Stages hold contiguous layers, so the order is the pp = 1 order."""
    import torch
    import torch.distributed as dist

    group = ranks.pp_group
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else None
    device = device or torch.device("cpu")
    for source in range(ranks.pp_size):
        src = dist.get_global_rank(group, source)
        if source == ranks.pp_rank:
            for name, tensor in stage:
                payload = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
                encoded = torch.tensor(list(name.encode()), dtype=torch.uint8, device=payload.device)
                dtype = str(tensor.dtype).removeprefix("torch.")
                if tensor.ndim > _MAX_DIMS or dtype not in _WIRE_DTYPES:
                    raise MappingError(
                        f"{name}: a {dtype} tensor of {tensor.ndim} dims cannot cross the pipeline"
                    )
                header = [len(encoded), _WIRE_DTYPES.index(dtype), tensor.ndim]
                header += list(tensor.shape) + [0] * (_MAX_DIMS - tensor.ndim)
                dist.broadcast(
                    torch.tensor(header, dtype=torch.int64, device=payload.device), src, group=group
                )
                dist.broadcast(encoded, src, group=group)
                dist.broadcast(payload, src, group=group)
                yield name, tensor
            end = torch.full((3 + _MAX_DIMS,), _END, dtype=torch.int64, device=device)
            dist.broadcast(end, src, group=group)
            continue
        while True:
            header = torch.empty(3 + _MAX_DIMS, dtype=torch.int64, device=device)
            dist.broadcast(header, src, group=group)
            length, dtype_index, ndim, *shape = header.tolist()
            if length == _END:
                break
            encoded = torch.empty(length, dtype=torch.uint8, device=device)
            dist.broadcast(encoded, src, group=group)
            dtype = getattr(torch, _WIRE_DTYPES[dtype_index])
            tensor = torch.empty(shape[:ndim], dtype=dtype, device=device)
            dist.broadcast(tensor.reshape(-1).view(torch.uint8), src, group=group)
            yield bytes(encoded.tolist()).decode(), tensor


def _position(rest: str, order: list[str], name: str) -> int:
    if rest not in order:
        raise MappingError(f"model tensor {name}: not a Megatron tensor of this model config's layer")
    return order.index(rest)
