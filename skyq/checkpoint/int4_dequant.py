"""W4A16 (compressed-tensors pack-quantized) -> BF16, symmetric or asymmetric.

Every `X.weight_packed` needs `X.weight_scale` and `X.weight_shape` (and `X.weight_zero_point` when
the config says `symmetric: false`), found anywhere through the index; a missing member, an orphan
member, a shape that contradicts the packing, or a group size not dividing K is refused naming the
tensor, before anything is written. The config block may sit at the root or under `text_config`.
"""

from __future__ import annotations

import copy
import math
import re
from dataclasses import dataclass
from typing import Any

import torch

from skyq.checkpoint.errors import CheckpointError
from skyq.checkpoint.pipeline import ShardTransform, tensorwise_transform
from skyq.checkpoint.reader import ShardedCheckpoint, TensorInfo
from skyq.quant import int4
from skyq.quant.kernels import dispatch

MEMBERS = ("weight_scale", "weight_shape", "weight_zero_point")


@dataclass(frozen=True)
class PackedLayout:
    group_size: int
    symmetric: bool


def packed_layout_from_block(block: dict[str, Any] | None, where: str) -> PackedLayout:
    if block is None:
        raise CheckpointError(
            f"{where}: no quantization_config (root or text_config); not an INT4 checkpoint"
        )
    if block.get("quant_method") != "compressed-tensors" or block.get("format") != "pack-quantized":
        raise CheckpointError(
            f"{where}: quant_method {block.get('quant_method')!r} / format {block.get('format')!r} is not "
            "compressed-tensors pack-quantized; FP8 checkpoints: use convert_fp8_to_bf16"
        )
    groups = block.get("config_groups") or {}
    if len(groups) != 1:
        raise CheckpointError(f"{where}: expected one config group, found {sorted(groups)}")
    weights = next(iter(groups.values())).get("weights") or {}
    if weights.get("num_bits") != 4 or weights.get("type") != "int" or weights.get("strategy") != "group":
        raise CheckpointError(
            f"{where}: weights must be 4-bit int groups, got num_bits={weights.get('num_bits')} "
            f"type={weights.get('type')} strategy={weights.get('strategy')}"
        )
    group_size = weights.get("group_size")
    if not isinstance(group_size, int) or group_size <= 0:
        raise CheckpointError(f"{where}: invalid group_size {group_size!r}")
    return PackedLayout(group_size=group_size, symmetric=bool(weights.get("symmetric", True)))


def group_packed_weights(tensors: dict[str, TensorInfo], layout: PackedLayout) -> dict[str, dict[str, str]]:
    """packed name -> {member: tensor name}, validated from headers."""
    units: dict[str, dict[str, str]] = {}
    needed = MEMBERS if not layout.symmetric else MEMBERS[:2]
    for name, info in sorted(tensors.items()):
        if not name.endswith(".weight_packed"):
            continue
        base = name.removesuffix("_packed")
        members = {m: f"{base[: -len('weight')]}{m}" for m in needed}
        for member, member_name in members.items():
            if member_name not in tensors:
                raise CheckpointError(
                    f"tensor {name!r} in {info.shard}: its {member} {member_name!r} is in no shard; "
                    "the checkpoint is corrupt (a packed weight is never kept without its scale)"
                )
        _check_shapes(name, info, {m: tensors[n] for m, n in members.items()}, layout)
        units[name] = members
    if not units:
        raise CheckpointError("no `*.weight_packed` tensor in the checkpoint: nothing to dequantize")
    owned = {n for members in units.values() for n in members.values()}
    orphans = sorted(n for n in tensors if n.rsplit(".", 1)[-1] in MEMBERS and n not in owned)
    if orphans:
        raise CheckpointError(
            f"tensor {orphans[0]!r} in {tensors[orphans[0]].shard} has no `weight_packed` to go with"
        )
    return units


def _check_shapes(
    name: str, packed: TensorInfo, members: dict[str, TensorInfo], layout: PackedLayout
) -> None:
    scale = members["weight_scale"]
    if packed.dtype != "I32" or len(packed.shape) != 2:
        raise CheckpointError(
            f"tensor {name!r} in {packed.shard}: expected 2-D I32, got {packed.dtype} {list(packed.shape)}"
        )
    n, words = packed.shape
    if len(scale.shape) != 2 or scale.shape[0] != n:
        raise CheckpointError(
            f"scale {scale.name!r} in {scale.shard}: shape {list(scale.shape)} does not match {n} rows"
        )
    k = scale.shape[1] * layout.group_size
    if math.ceil(k / 8) != words:
        raise CheckpointError(
            f"tensor {name!r} in {packed.shard}: {words} packed words per row, but {scale.shape[1]} groups of "
            f"group_size {layout.group_size} make K = {k} (needs {math.ceil(k / 8)} words); config and tensors disagree"
        )


def make_int4_dequant_transform(
    source: ShardedCheckpoint, units: dict[str, dict[str, str]], layout: PackedLayout
) -> ShardTransform:
    members = {n for m in units.values() for n in m.values()}

    def fetch(name: str, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        return tensors[name] if name in tensors else source.read_tensor(name)

    def dequantize(name: str, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        device = tensors[name].device  # a member read from another shard is on the CPU
        m = {key: fetch(n, tensors).to(device) for key, n in units[name].items()}
        shape = [int(v) for v in m["weight_shape"].tolist()]
        if len(shape) != 2 or shape[1] % layout.group_size:
            raise CheckpointError(
                f"{units[name]['weight_shape']!r} = {shape}: K must be a multiple of group_size {layout.group_size}"
            )
        base = name.removesuffix(".weight_packed")
        if layout.symmetric:
            return dispatch.dequantize_int4_packed(
                tensors[name], m["weight_scale"], shape, group_size=layout.group_size, name=base
            )
        return int4.dequantize_asymmetric(
            tensors[name], m["weight_scale"], m["weight_zero_point"], shape, name=base
        )

    def convert(name: str, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {name.removesuffix("_packed"): dequantize(name, tensors)}

    return tensorwise_transform(convert, converts=units, consumed=members)


def sidecar_block(block: dict[str, Any], tensors: dict[str, TensorInfo]) -> dict[str, Any]:
    """The stripped block for `quantization_config.json`, its ignore list extended by every top-level
    namespace with unquantized weights and no packed ones (K2.6 omits `vision_tower` / `mm_projector`;
    an engine given the block would otherwise look for `weight_packed` there)."""
    sidecar = copy.deepcopy(block)
    packed_roots = {n.split(".", 1)[0] for n in tensors if n.endswith(".weight_packed")}
    plain_roots = {n.split(".", 1)[0] for n in tensors if n.endswith(".weight") and "." in n}
    ignore = list(sidecar.get("ignore") or [])
    for root in sorted(plain_roots - packed_roots):
        rule = f"re:{re.escape(root)}\\..*"
        if rule not in ignore:
            ignore.append(rule)
    sidecar["ignore"] = ignore
    return sidecar
