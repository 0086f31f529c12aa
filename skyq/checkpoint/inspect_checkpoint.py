"""What a checkpoint is and whether it is sound: the engine of `python -m skyq.tools.inspect`.

Reports the format (bf16, fp8 blockwise / per-channel / per-tensor, mxfp8, int4 W4A16), quantized
and kept tensors by role, scale sanity (finite, positive, powers of two where `scale_fmt: ue8m0`
claims so; no 0xFF byte in E8M0 scales), index and config consistency (total_size in bytes, quantized tensors <=> config
block, skip/ignore lists <=> tensors) and bytes. `verify=True` also reads every tensor (finite
values, no e4m3 NaN codes) and checks every file against `skyq_manifest.json`: its sha256 and size,
that every shard of the index is listed, and that every shard was converted from the same inputs
(a shard of another conversion makes the output a mix of two checkpoints).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch

from skyq.checkpoint.errors import CheckpointError
from skyq.checkpoint.fp8_dequant import (
    FP8_DTYPE,
    find_quantization_config,
    fp8_layout_from_config,
    pair_fp8_weights,
)
from skyq.checkpoint.hf_config import model_config_from_hf
from skyq.checkpoint.int4_convert import matches_ignore_rule
from skyq.checkpoint.int4_dequant import group_packed_weights, packed_layout_from_block
from skyq.checkpoint.manifest import MANIFEST_NAME, read_manifest, verify_files
from skyq.checkpoint.reader import INDEX_NAME, ShardedCheckpoint, load_json
from skyq.quant import fp8_blockwise, mxfp8
from skyq.quant.layouts import LINEAR_ROLES, LayoutError, get_layout


@dataclass
class InspectReport:
    lines: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def render(self) -> str:
        out = list(self.lines)
        out += [f"PROBLEM: {p}" for p in self.problems] or ["no problems found"]
        return "\n".join(out)


def inspect_checkpoint(model_dir: Path, *, verify: bool = False) -> InspectReport:
    report = InspectReport()
    try:
        source = ShardedCheckpoint(model_dir)
        config = source.config()
    except CheckpointError as e:
        report.problems.append(str(e))
        return report
    block = find_quantization_config(config)
    quantized = _check_format(source, config, block, report)
    _count_roles(source, config, quantized, report)
    _check_index(source, report)
    disk = sum(source.shard_bytes(s) for s in source.shard_names)
    report.lines.append(
        f"bytes: {disk} on disk in {len(source.shard_names)} shard(s), {len(source.tensors)} tensors"
    )
    if verify:
        _verify(source, report)
    return report


def _check_format(
    source: ShardedCheckpoint, config: dict, block: dict | None, report: InspectReport
) -> dict[str, str]:
    """Describe the format, check scales; returns {weight or packed name: its base `.weight` name}."""
    where = str(source.dir / "config.json")
    dtypes = Counter(info.dtype for info in source.tensors.values())
    has_fp8 = dtypes[FP8_DTYPE] > 0
    has_packed = any(n.endswith(".weight_packed") for n in source.tensors)
    method = None if block is None else block.get("quant_method")
    fmt = None if block is None else block.get("format")
    try:
        if block is None:
            report.lines.append(
                "format: unquantized (" + ", ".join(f"{d} x{c}" for d, c in sorted(dtypes.items())) + ")"
            )
            if has_fp8 or has_packed:
                report.problems.append(f"{where}: quantized tensors present but no quantization_config")
            return {}
        if method == "compressed-tensors" and fmt == "pack-quantized":
            layout = packed_layout_from_block(block, where)
            kind = "symmetric" if layout.symmetric else "asymmetric (cannot serve INT4 QAT)"
            report.lines.append(f"format: int4 W4A16 pack-quantized, group {layout.group_size}, {kind}")
            units = group_packed_weights(source.tensors, layout)
            _check_scales(source, [m["weight_scale"] for m in units.values()], pow2=False, report=report)
            _check_skip_list(block.get("ignore") or [], source, set(units), config, report)
            return {n: n.removesuffix("_packed") for n in units}
        layout = fp8_layout_from_config(config, where)
        pairs = pair_fp8_weights(source.tensors, layout)
        if layout.e8m0:
            report.lines.append("format: mxfp8 e4m3, 1 x 32 blocks, E8M0 uint8 scales (mxfp8-quantized)")
            _check_e8m0_scales(source, list(pairs.values()), report)
        else:
            pow2 = block.get("scale_fmt") == "ue8m0"
            grain = f"blockwise {list(layout.block_size)}" if layout.block_size else "per-channel/per-tensor"
            report.lines.append(f"format: fp8 e4m3 {grain}" + (", ue8m0 scales" if pow2 else ""))
            _check_scales(source, list(pairs.values()), pow2=pow2, report=report)
        skip = block.get("modules_to_not_convert") or block.get("ignore") or []
        _check_skip_list(skip, source, set(pairs), config, report)
        return {n: n for n in pairs}
    except CheckpointError as e:
        report.problems.append(str(e))
        return {}


def _check_scales(source: ShardedCheckpoint, names: list[str], *, pow2: bool, report: InspectReport) -> None:
    bad = 0
    for name in names:
        scale = source.read_tensor(name).float()
        if not torch.isfinite(scale).all() or not (scale > 0).all():
            report.problems.append(
                f"scale {name!r} in {source.tensors[name].shard}: non-finite or non-positive values"
            )
            bad += 1
        elif pow2 and not fp8_blockwise.is_pow2(scale):
            report.problems.append(f"scale {name!r}: scale_fmt ue8m0 claims powers of two, values are not")
            bad += 1
    report.lines.append(f"scales: {len(names)} checked, {bad} bad")


def _check_e8m0_scales(source: ShardedCheckpoint, names: list[str], report: InspectReport) -> None:
    """E8M0 bytes are powers of two by construction; 0xFF is the format's NaN and is never written."""
    bad = 0
    for name in names:
        n_nan = int((source.read_tensor(name) == mxfp8.E8M0_NAN).sum())
        if n_nan:
            report.problems.append(
                f"scale {name!r} in {source.tensors[name].shard}: {n_nan} E8M0 NaN byte(s) (0xFF)"
            )
            bad += 1
    report.lines.append(f"scales: {len(names)} checked, {bad} bad")


def _not_linear(source: ShardedCheckpoint, config: dict) -> set[str]:
    """Weights the layout says belong to no linear layer (embeddings): no skip list needs them.
    Empty when the roles are unknown, so every 2-D weight is then expected in the list."""
    try:
        model_cfg = model_config_from_hf(config)
    except ValueError:
        return set()
    layout, out = get_layout(model_cfg.family), set()
    for name in source.tensors:
        try:
            if name.endswith(".weight") and layout.role(name, model_cfg) not in LINEAR_ROLES:
                out.add(name)
        except LayoutError:
            continue  # reported by the role count
    return out


def _check_skip_list(
    rules: list[str], source: ShardedCheckpoint, quantized: set[str], config: dict, report: InspectReport
) -> None:
    """Quantized modules must not be skipped; every unquantized linear weight's module must be."""
    for name in sorted(quantized):
        module = name.rsplit(".", 1)[0]
        if any(matches_ignore_rule(module, r) for r in rules):
            report.problems.append(f"{module}: quantized, yet the config's skip/ignore list names it")
    not_linear = _not_linear(source, config)
    plain = sorted(
        n
        for n, i in source.tensors.items()
        if n.endswith(".weight") and len(i.shape) == 2 and i.dtype != FP8_DTYPE and n not in not_linear
    )
    unlisted = [n for n in plain if not any(matches_ignore_rule(n.removesuffix(".weight"), r) for r in rules)]
    if unlisted:
        report.problems.append(
            f"{len(unlisted)} unquantized linear weight(s) missing from the skip/ignore list, e.g. {unlisted[0]!r} "
            "(an engine would look for its quantized form)"
        )


def _count_roles(
    source: ShardedCheckpoint, config: dict, quantized: dict[str, str], report: InspectReport
) -> None:
    try:
        model_cfg = model_config_from_hf(config)
    except ValueError as e:
        report.lines.append(f"roles: not counted ({e})")
        return
    layout = get_layout(model_cfg.family)
    side = {
        n
        for n in source.tensors
        if n.rsplit(".", 1)[-1] in ("weight_scale", "weight_scale_inv", "weight_shape", "weight_zero_point")
    }
    counts: Counter[tuple[str, str]] = Counter()
    for name in sorted(source.tensors):
        if name in side and name not in quantized:
            continue
        try:
            role = layout.role(quantized.get(name, name), model_cfg).value
        except LayoutError as e:
            report.problems.append(f"tensor {name!r}: {e}")
            continue
        counts[(role, "quantized" if name in quantized else "kept")] += 1
    roles = sorted({r for r, _ in counts})
    report.lines.append(
        f"model: {model_cfg.name} ({model_cfg.family.value}), text prefix {model_cfg.text_prefix!r}"
    )
    for role in roles:
        report.lines.append(
            f"  {role:<14} quantized {counts[(role, 'quantized')]:>6}  kept {counts[(role, 'kept')]:>6}"
        )


def _check_index(source: ShardedCheckpoint, report: InspectReport) -> None:
    if not source.has_index:
        return
    tensor_bytes = sum(i.nbytes for i in source.tensors.values())
    total = load_json(source.dir / INDEX_NAME).get("metadata", {}).get("total_size")
    if total != tensor_bytes:
        report.problems.append(
            f"{source.dir / INDEX_NAME}: metadata.total_size={total}, tensors hold {tensor_bytes} bytes"
        )
    report.lines.append(f"index: {len(source.weight_map)} tensors, total_size {total}")


def _verify(source: ShardedCheckpoint, report: InspectReport) -> None:
    manifest_path = source.dir / MANIFEST_NAME
    if manifest_path.exists():
        try:
            manifest = read_manifest(manifest_path)
            problems = verify_files(source.dir, manifest)
            problems += [
                f"{source.dir / s}: in the index but not in {MANIFEST_NAME} (not written by this conversion)"
                for s in source.shard_names
                if s not in manifest["files"]
            ]
            if manifest.get("inputs_id") is None:
                report.lines.append(
                    "provenance: not recorded (an older skyq); a mixed output cannot be detected"
                )
        except CheckpointError as e:
            problems = [str(e)]
        report.problems += problems
        report.lines.append(f"manifest: checked, {len(problems)} mismatch(es)")
    else:
        report.lines.append("manifest: none (not written by skyq); payload checksums cannot be verified")
    for shard in source.shard_names:
        for name, tensor in source.read_shard(shard).items():
            if tensor.dtype == torch.float8_e4m3fn:
                if ((tensor.view(torch.uint8) & 0x7F) == 0x7F).any():
                    report.problems.append(f"tensor {name!r} in {shard}: e4m3 NaN codes")
            elif tensor.is_floating_point() and not torch.isfinite(tensor).all():
                report.problems.append(f"tensor {name!r} in {shard}: NaN or inf values")
