"""Checkpoint-role rules: each checkpoint must be in the format its role and the precision need.

The seeds' silent failures live here: a rollout engine booted from the BF16 cast drops every
quantized push; an asymmetric INT4 checkpoint cannot serve QAT; a W4A16 checkpoint given as the
trainer's start point; a checkpoint of another model (its config.json's layers, hidden size, experts
or expert width differ from model.*), or one quantized with another scope or scale format than the
precision's. Paths that do not exist are reported as skipped checks, not errors.
"""

from __future__ import annotations

from skyq.config.checkpoint_info import CheckpointQuantization, read_checkpoint_quantization
from skyq.config.enums import ModelFamily, Precision, QuantScope, ScaleFormat
from skyq.config.schema import CheckpointConfig, ModelConfig, PrecisionConfig

_CONVERT = {
    Precision.fp8_blockwise: "python -m skyq.tools.convert_hf_to_fp8 --model-dir <bf16 dir> --save-dir <fp8 dir> "
    "--block-size {bn} {bk}",
    Precision.mxfp8: "python -m skyq.tools.convert_hf_to_mxfp8 --model-dir <bf16 dir> --save-dir <mxfp8 dir> "
    "--targets {targets}",
    Precision.int4_qat: "python -m skyq.tools.convert_hf_to_int4 --model-dir <bf16 dir> --save-dir <int4 dir> "
    "--group-size {g} --grid {grid}",
}


def checkpoint_errors(
    *, precision: PrecisionConfig, model: ModelConfig, checkpoint: CheckpointConfig
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
            continue
        errors += _shape_errors(f"checkpoint.{key}={path}", info, model)
        if info.is_quantized:
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
    errors += _shape_errors(f"checkpoint.rollout_checkpoint={path}", info, model)
    errors += _rollout_errors(precision, info, convert)
    return errors, skipped


def _arch_keys(family: ModelFamily) -> dict[str, str]:
    """model.* key -> the config.json key of the same size in `family`'s HF config."""
    experts = "n_routed_experts" if family is ModelFamily.deepseek_v3 else "num_experts"
    return {
        "num_layers": "num_hidden_layers",
        "hidden_size": "hidden_size",
        "num_experts": experts,
        "moe_intermediate_size": "moe_intermediate_size",
    }


def _shape_errors(key: str, info: CheckpointQuantization, model: ModelConfig) -> list[str]:
    """The checkpoint's config.json against model.*: a checkpoint of another model would be loaded
    into (or pushed from) a model of this shape. Sizes config.json does not state are not compared."""
    differ = [
        f"{hf_key}={info.arch[hf_key]} vs model.{ours}={getattr(model, ours)}"
        for ours, hf_key in _arch_keys(model.family).items()
        if hf_key in info.arch and info.arch[hf_key] != getattr(model, ours)
    ]
    if not differ:
        return []
    return [
        f"{key} is another model than model={model.name}: its config.json has {'; '.join(differ)}. "
        "Fix: the checkpoint of this model, or the model preset of that checkpoint."
    ]


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
        errors = _scope_errors(key, info, "precision.fp8_targets", precision.fp8_targets, convert)
        scales = ScaleFormat.ue8m0 if info.pow2_scales else ScaleFormat.fp32
        if scales is not precision.scale_format:
            errors.append(
                f"{key} has {'scale_fmt=ue8m0 (power-of-two scales)' if info.pow2_scales else 'fp32 scales'} "
                f"but precision.scale_format={precision.scale_format.value}: trainer and engine would round "
                f"the weights differently. Fix: precision.scale_format={scales.value}, or re-convert: {convert}"
                + (" --scale-fmt ue8m0" if precision.scale_format is ScaleFormat.ue8m0 else "")
            )
        return errors
    if name is Precision.mxfp8:
        if info.ct_format != "mxfp8-quantized":
            return [
                f"{key} has quant_method={info.quant_method}, format={info.ct_format}; precision=mxfp8 needs a "
                f"compressed-tensors mxfp8-quantized checkpoint. Fix: {convert}"
            ]
        return _scope_errors(key, info, "precision.mxfp8_targets", precision.mxfp8_targets, convert)
    return _int4_errors(precision, info, key, convert)


def _scope_errors(
    key: str, info: CheckpointQuantization, scope_key: str, scope: QuantScope, convert: str
) -> list[str]:
    """An all-linear checkpoint under an expert-only run, or the reverse: the engine would hold
    quantized attention the trainer computes in bf16 (or the other way round)."""
    theirs = QuantScope.all_linear if info.quantizes_attention else QuantScope.routed_experts
    if theirs is scope:
        return []
    return [
        f"{key} quantizes {'attention and experts' if info.quantizes_attention else 'routed experts only'} "
        f"({theirs.value}) but {scope_key}={scope.value}. Fix: {scope_key}={theirs.value}, or re-convert: {convert}"
    ]


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
