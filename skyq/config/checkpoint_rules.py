"""Checkpoint-role rules: each checkpoint must be in the format its role and the precision need.

The seeds' silent failures live here: a rollout engine booted from the BF16 cast drops every
quantized push; an asymmetric INT4 checkpoint cannot serve QAT; a W4A16 checkpoint given as the
trainer's start point. Paths that do not exist are reported as skipped checks, not errors.
"""

from __future__ import annotations

from skyq.config.checkpoint_info import CheckpointQuantization, read_checkpoint_quantization
from skyq.config.enums import Precision
from skyq.config.schema import CheckpointConfig, PrecisionConfig

_CONVERT = {
    Precision.fp8_blockwise: "python -m skyq.tools.convert_hf_to_fp8 --model-dir <bf16 dir> --save-dir <fp8 dir> "
    "--block-size {bn} {bk}",
    Precision.mxfp8: "python -m skyq.tools.convert_hf_to_mxfp8 --model-dir <bf16 dir> --save-dir <mxfp8 dir> "
    "--targets {targets}",
    Precision.int4_qat: "python -m skyq.tools.convert_hf_to_int4 --model-dir <bf16 dir> --save-dir <int4 dir> "
    "--group-size {g} --grid {grid}",
}


def checkpoint_errors(
    *, precision: PrecisionConfig, checkpoint: CheckpointConfig
) -> tuple[list[str], list[str]]:
    """(errors, skipped checks) for the checkpoint roles of a run."""
    errors: list[str] = []
    skipped: list[str] = []
    convert = _CONVERT.get(precision.name, "").format(
        bn=precision.block_size[0],
        bk=precision.block_size[-1],
        g=precision.int4_group_size,
        grid=precision.int4_grid.value,
        targets=precision.mxfp8_targets.value,
    )
    for key in ("hf_checkpoint", "ref_load"):
        path = getattr(checkpoint, key)
        if path is None:
            continue
        info = read_checkpoint_quantization(path)
        if info is None:
            skipped.append(f"checkpoint.{key}={path} does not exist here: its BF16 format was not checked")
        elif info.is_quantized:
            errors.append(
                f"checkpoint.{key}={path} is quantized (quant_method={info.quant_method}); the trainer and the "
                "reference model need BF16 weights. Did you swap checkpoint.hf_checkpoint and "
                "checkpoint.rollout_checkpoint? Fix: point it at the BF16 checkpoint (convert with "
                "python -m skyq.tools.convert_moe_int4_to_bf16 / convert_fp8_to_bf16)."
            )
    path = checkpoint.rollout_checkpoint
    if path is None:
        return errors, skipped
    info = read_checkpoint_quantization(path)
    if info is None:
        skipped.append(
            f"checkpoint.rollout_checkpoint={path} does not exist here: its format vs "
            f"precision.name={precision.name.value} was not checked"
        )
        return errors, skipped
    errors += _rollout_errors(precision, info, convert)
    return errors, skipped


def _rollout_errors(precision: PrecisionConfig, info: CheckpointQuantization, convert: str) -> list[str]:
    key = f"checkpoint.rollout_checkpoint={info.path}"
    name = precision.name
    if name is Precision.bf16:
        if info.is_quantized:
            return [
                f"{key} is quantized (quant_method={info.quant_method}) but precision.name=bf16 pushes BF16 "
                "weights. Fix: boot the engine from the BF16 checkpoint, or pick the matching precision."
            ]
        return []
    if not info.is_quantized:
        return [
            f"{key} is a BF16 checkpoint but precision.name={name.value} pushes quantized weights: the engine "
            "would register BF16 parameters and drop every quantized push. Fix: convert it first: " + convert
        ]
    if name is Precision.fp8_blockwise:
        block = info.block.get("weight_block_size")
        if info.quant_method != "fp8":
            return [
                f"{key} has quant_method={info.quant_method}; precision=fp8_blockwise needs fp8. Fix: {convert}"
            ]
        if list(block or []) != list(precision.block_size):
            return [
                f"{key} has weight_block_size={block} but precision.block_size={list(precision.block_size)}. "
                f"Fix: set precision.block_size={block} or re-convert: {convert}"
            ]
        return []
    if name is Precision.mxfp8:
        if info.ct_format != "mxfp8-quantized":
            return [
                f"{key} has quant_method={info.quant_method}, format={info.ct_format}; precision=mxfp8 needs a "
                f"compressed-tensors mxfp8-quantized checkpoint. Fix: {convert}"
            ]
        return []
    return _int4_errors(precision, info, key, convert)


def _int4_errors(
    precision: PrecisionConfig, info: CheckpointQuantization, key: str, convert: str
) -> list[str]:
    if info.quant_method != "compressed-tensors" or info.ct_format != "pack-quantized":
        return [
            f"{key} has quant_method={info.quant_method}, format={info.ct_format}; precision=int4_qat needs a "
            f"compressed-tensors pack-quantized (W4A16) checkpoint. Fix: {convert}"
        ]
    weights = info.ct_weights()
    errors = []
    if weights.get("symmetric") is not True:
        errors.append(
            f"{key} is asymmetric INT4 (symmetric={weights.get('symmetric')}): zero points cannot serve INT4 QAT, "
            f"whose fake-quant is symmetric. Fix: re-convert symmetric: {convert}"
        )
    if weights.get("group_size") != precision.int4_group_size:
        errors.append(
            f"{key} has group_size={weights.get('group_size')} but precision.int4_group_size="
            f"{precision.int4_group_size}. Fix: set precision.int4_group_size={weights.get('group_size')} "
            f"(Qwen3 recipes use 128, Kimi-K2.x 32) or re-convert."
        )
    return errors
