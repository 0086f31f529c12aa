"""Cross-field validation: every mistake the seeds warn about in prose, refused before a GPU is touched.

`validate(cfg)` collects every problem and raises one ConfigValidationError (a ValueError) whose
lines each name the keys, the values and the fix. Checks that need a checkpoint on disk are listed in
the report's `skipped` when the path does not exist (a dry run on a laptop); `validate(cfg,
run_here=True)`, what `python -m skyq.train` calls before a real run, refuses them instead, with the
other facts of this machine a run needs (wandb's API key for logger.wandb_mode=online).
"""

from __future__ import annotations

import dataclasses
import math
import netrc
import os
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

from skyq.config.backends import ignored_setting_errors
from skyq.config.checkpoint_rules import checkpoint_errors
from skyq.config.enums import (
    Device,
    Fp8Recipe,
    LoggerBackend,
    ModelFamily,
    Placement,
    Precision,
    RolloutBackend,
    RopeScaling,
    TaskName,
    TrainerBackend,
    WeightSyncMode,
)
from skyq.config.resolve import resolve_transport
from skyq.config.schema import PrecisionConfig, TrainConfig
from skyq.config.shard_rules import ShardCheck, shard_checks, shard_errors


class ConfigValidationError(ValueError):
    """One or more cross-field rules failed; each line names keys, values and the fix."""

    def __init__(self, errors: list[str]):
        self.errors = errors
        super().__init__("invalid skyq config:\n" + "\n".join(f"  - {e}" for e in errors))


@dataclass
class ValidationReport:
    shard_checks: list[ShardCheck] = field(default_factory=list)
    """Every shard-divisibility row (for the dry run)."""
    skipped: list[str] = field(default_factory=list)
    """Checks that could not be made (checkpoint paths that do not exist here)."""


def trainer_dp(cfg: TrainConfig) -> int:
    """Data-parallel size of the trainer: given, or derived from the GPUs and the other sizes."""
    p = cfg.topology.parallel
    if p.dp is not None:
        return p.dp
    return max(cfg.topology.trainer_gpus // (p.tp * p.pp * p.cp), 1)


def num_engines(cfg: TrainConfig) -> int:
    """Engines of the rollout group: `rollout.num_engines`, else derived from the topology."""
    if cfg.rollout.num_engines is not None:
        return cfg.rollout.num_engines
    if cfg.topology.device is Device.cpu:
        return 1
    return cfg.topology.rollout_gpus // cfg.rollout.gpus_per_engine


def validate(cfg: TrainConfig, *, run_here: bool = False) -> ValidationReport:
    """Check every cross-field rule; raise ConfigValidationError listing all failures.

    `run_here`: the config is about to run on this machine, so every checkpoint path it reads must
    exist here (else it is a skipped check, as in a dry run) and wandb online needs its API key.
    """
    report = ValidationReport()
    errors: list[str] = _range_errors(cfg)
    errors += _precision_errors(cfg)
    errors += precision_env_conflicts(cfg.precision, trainer_env=cfg.trainer.env, rollout_env=cfg.rollout.env)
    errors += _model_errors(cfg)
    errors += _topology_errors(cfg) or _placement_errors(cfg)
    errors += _length_errors(cfg)
    errors += _algorithm_errors(cfg)
    errors += _transport_errors(cfg)
    errors += _choice_errors(cfg)
    errors += _backend_errors(cfg)
    if run_here:
        errors += _this_machine_errors(cfg)
    gpu = cfg.topology.device is Device.cuda
    report.shard_checks = shard_checks(
        model=cfg.model, precision=cfg.precision, parallel=cfg.topology.parallel, rollout=cfg.rollout, gpu=gpu
    )
    errors += shard_errors(report.shard_checks)
    ckpt_errors, report.skipped = checkpoint_errors(
        precision=cfg.precision, model=cfg.model, checkpoint=cfg.checkpoint
    )
    errors += ckpt_errors
    if errors:
        raise ConfigValidationError(errors)
    return report


INT64 = (-(2**63), 2**63 - 1)
"""The integers a run can hand to torch, numpy and the checkpoint files (a Python int has no bound)."""


def _range_errors(node: object, prefix: str = "") -> list[str]:
    """Every numeric field outside the `Range` its schema field declares (`schema.bounded`), named by
    its full key, with the allowed values and what the field means; and, for every field, a float
    that is nan or infinite (no range admits it, and `nan < x` is False for every bound) or an int
    beyond int64 (which the run would only meet as an OverflowError once its workers start)."""
    errors = []
    for f in dataclasses.fields(node):  # type: ignore[arg-type]
        value, key = getattr(node, f.name), f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            errors += _range_errors(value, f"{key}.")
        if isinstance(value, float) and not math.isfinite(value):
            errors.append(f"{key}={value} must be a finite number.")
            continue
        if isinstance(value, int) and not isinstance(value, bool) and not INT64[0] <= value <= INT64[1]:
            errors.append(f"{key}={value} does not fit in 64 bits (must be in [{INT64[0]}, {INT64[1]}]).")
            continue
        rng = f.metadata.get("range")
        if rng is not None and value is not None and value not in rng:
            from skyq.config.docs import field_docs  # the schema's docstrings, read only for a message

            meaning = field_docs(type(node)).get(f.name, "")
            errors.append(
                f"{key}={value!r} must be {rng}" + (f" ({meaning.rstrip('.')})." if meaning else ".")
            )
    return errors


MOE_TOKEN_DISPATCHERS = ("alltoall", "allgather", "flex")
"""Megatron's MoE token dispatchers (`trainer.moe_token_dispatcher`; flex is DeepEP's)."""

WANDB_MODES = ("online", "offline", "disabled")
"""wandb's run modes (`logger.wandb_mode`)."""


def _choice_errors(cfg: TrainConfig) -> list[str]:
    """String keys with a fixed set of values, and settings the chosen backends would silently ignore."""
    errors = []
    if cfg.algorithm.name != "grpo":
        errors.append(
            f"algorithm.name={cfg.algorithm.name!r}: skyq implements grpo only. Fix: algorithm.name=grpo."
        )
    if cfg.trainer.moe_token_dispatcher not in MOE_TOKEN_DISPATCHERS:
        errors.append(
            f"trainer.moe_token_dispatcher={cfg.trainer.moe_token_dispatcher!r} must be one of "
            f"{', '.join(MOE_TOKEN_DISPATCHERS)}."
        )
    if cfg.logger.wandb_mode not in WANDB_MODES:
        errors.append(f"logger.wandb_mode={cfg.logger.wandb_mode!r} must be one of {', '.join(WANDB_MODES)}.")
    task = cfg.task
    if task.name is TaskName.arith and (task.dataset is not None or task.eval.dataset is not None):
        key, value = (
            ("task.dataset", task.dataset)
            if task.dataset is not None
            else ("task.eval.dataset", task.eval.dataset)
        )
        errors.append(
            f"{key}={value!r} with task.name=arith, "
            "which generates its own prompts and reads no dataset (it would be ignored). Fix: task=dapo_math "
            "for a JSONL file of {prompt, label} records, or drop the key."
        )
    if task.eval.interval and task.name is not TaskName.arith and task.eval.dataset is None:
        errors.append(
            f"task.eval.interval={task.eval.interval} with task.name={task.name.value} needs task.eval.dataset="
            "<a local .jsonl file> (only arith brings its own eval set). Fix: set it, or task.eval.interval=0."
        )
    return errors


def _backend_errors(cfg: TrainConfig) -> list[str]:
    """Settings the chosen backends would ignore (`skyq.config.backends`), and models they cannot build."""
    from skyq.checkpoint.hf_config import ModelBuildError, check_buildable

    errors = ignored_setting_errors(cfg)
    o = cfg.trainer.optimizer
    if cfg.trainer.backend is TrainerBackend.megatron and o.cpu_offload:
        # megatron-core's HybridDeviceOptimizer reuses the precision-aware code path (Megatron-LM's own
        # argument check requires both); without it, 0.19.2 raises KeyError loading a checkpoint
        if not o.precision_aware:
            errors.append(
                "trainer.optimizer.cpu_offload=true without trainer.optimizer.precision_aware=true: "
                "megatron-core's offloaded optimizer works through the precision-aware path (without it a "
                "checkpoint does not load back). Fix: trainer.optimizer.precision_aware=true."
            )
        if cfg.precision.persistent_fp8_params:
            errors.append(
                "trainer.optimizer.cpu_offload=true with precision.persistent_fp8_params=true: megatron-core "
                "offloads the optimizer of FP8 parameters only with delayed scaling, which skyq does not use. "
                "Fix: persistent_fp8_params=false, or cpu_offload=false."
            )
    if cfg.trainer.backend is TrainerBackend.torch or cfg.rollout.backend is RolloutBackend.embedded:
        try:
            check_buildable(cfg.model)
        except ModelBuildError as exc:
            errors.append(str(exc))
    return errors


def _this_machine_errors(cfg: TrainConfig) -> list[str]:
    """What a run needs of this machine that a dry run elsewhere cannot check: the checkpoint paths it
    reads exist, and wandb online has an API key (else wandb fails or prompts once the workers are up)."""
    errors = []
    for key in ("hf_checkpoint", "rollout_checkpoint", "ref_load", "load"):
        path = getattr(cfg.checkpoint, key)
        if path is not None and not Path(path).expanduser().exists():
            errors.append(
                f"checkpoint.{key}={path} does not exist on this machine. Fix: the path of the checkpoint "
                "directory here, or dry_run=true to check the config without it."
            )
    log = cfg.logger
    if log.backend is LoggerBackend.wandb and log.wandb_mode == "online" and not _wandb_key_present():
        errors.append(
            "logger.wandb_mode=online needs a wandb API key: none in WANDB_API_KEY or ~/.netrc. "
            "Fix: export WANDB_API_KEY=..., run `wandb login`, or logger.wandb_mode=offline."
        )
    return errors


def _wandb_key_present() -> bool:
    """wandb's own sources of a key: the environment, then the netrc entry `wandb login` writes for
    its host (WANDB_BASE_URL's, api.wandb.ai by default)."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname or "api.wandb.ai"
    try:
        return host in netrc.netrc(os.environ.get("NETRC") or None).hosts
    except (OSError, netrc.NetrcParseError):
        return False


def _transport_errors(cfg: TrainConfig) -> list[str]:
    """The embedded engine's sync transport must fit the placement (`auto` always does)."""
    if cfg.rollout.backend is not RolloutBackend.embedded:
        return []
    try:
        resolve_transport(cfg.topology, cfg.rollout.weight_sync.transport)
    except ValueError as exc:
        return [str(exc)]
    return []


def _precision_errors(cfg: TrainConfig) -> list[str]:
    p, errors = cfg.precision, []
    quantized_wire = p.name is not Precision.bf16
    if quantized_wire and cfg.rollout.weight_sync.mode is WeightSyncMode.delta:
        errors.append(
            f"rollout.weight_sync.mode=delta with precision.name={p.name.value}: incremental sync of a "
            "quantized wire format re-sends stale scales. Fix: rollout.weight_sync.mode=full (or precision=bf16)."
        )
    if p.name is Precision.mxfp8 and p.persistent_fp8_params:
        errors.append(
            "precision.persistent_fp8_params=true with precision.name=mxfp8: persistent FP8 parameters are "
            "blockwise-only. Fix: precision.persistent_fp8_params=false."
        )
    if p.name is Precision.mxfp8 and p.fp8_recipe.value == "blockwise":
        errors.append(
            "precision.fp8_recipe=blockwise contradicts precision.name=mxfp8. Fix: precision.fp8_recipe=auto "
            "(or mxfp8), or precision=fp8_blockwise."
        )
    if len(p.block_size) != 2 or min(p.block_size) <= 0:
        errors.append(
            f"precision.block_size={list(p.block_size)} must be two positive ints, e.g. [128, 128]."
        )
    if p.int4_group_size not in (32, 64, 128, 256):
        errors.append(f"precision.int4_group_size={p.int4_group_size} must be one of 32, 64, 128, 256.")
    return errors


def precision_env_conflicts(
    precision: PrecisionConfig,
    *,
    trainer_env: dict[str, str],
    rollout_env: dict[str, str],
    recipes: tuple[Fp8Recipe, ...] = (Fp8Recipe.blockwise, Fp8Recipe.mxfp8),
) -> list[str]:
    """`trainer.env` / `rollout.env` entries that give a variable the precision's strategy sets (for any
    FP8 recipe in `recipes` the workers may resolve) another value: the trainer and the engine would
    then quantize on different grids (e.g. VLLM_USE_DEEP_GEMM_E8M0=1 rounds fp32 scales to powers of
    two), a mismatch that raises nothing."""
    from skyq.quant.strategies import StrategyError, get_strategy

    strategy, errors = get_strategy(precision), []
    for recipe in recipes:
        try:
            env = strategy.env_vars(recipe)
        except StrategyError:  # refused on the workers that resolve it, naming the fix
            continue
        for side, user in (("trainer", trainer_env), ("engine", rollout_env)):
            key = "trainer.env" if side == "trainer" else "rollout.env"
            for name, value in sorted(user.items()):
                want = env[side].get(name)
                line = (
                    f"{key}.{name}={value} contradicts precision.name={precision.name.value} "
                    f"precision.scale_format={precision.scale_format.value}, which sets {name}={want} "
                    f"(trainer and engine would quantize on different grids). Fix: drop {key}.{name}, "
                    "or change precision.scale_format"
                )
                if want is not None and want != value and line not in errors:
                    errors.append(line)
    return errors


def _model_errors(cfg: TrainConfig) -> list[str]:
    """The model's sizes that must fit each other (each one's own range is `_range_errors`')."""
    m, errors = cfg.model, []
    if 1 <= m.num_experts < m.num_experts_per_tok:
        errors.append(
            f"model.num_experts_per_tok={m.num_experts_per_tok} exceeds model.num_experts={m.num_experts}: a token "
            "is routed to top-k distinct experts. Fix: a top-k <= the expert count."
        )
    if m.num_key_value_heads >= 1 and m.num_attention_heads % m.num_key_value_heads:
        errors.append(
            f"model.num_attention_heads={m.num_attention_heads} is not a multiple of model.num_key_value_heads="
            f"{m.num_key_value_heads} (grouped-query attention shares each key/value head among whole groups)."
        )
    if m.first_k_dense_replace > m.num_layers:
        errors.append(
            f"model.first_k_dense_replace={m.first_k_dense_replace} exceeds model.num_layers={m.num_layers}."
        )
    return errors + _rope_scaling_errors(cfg)


def _rope_scaling_errors(cfg: TrainConfig) -> list[str]:
    """YaRN that transformers, vLLM and Megatron would not compute alike, or that a backend lacks."""
    y, errors = cfg.model.rope_scaling, []
    if RopeScaling(y.type) is RopeScaling.none:
        return errors
    if not y.mscale_all_dim and y.mscale != 1:
        errors.append(
            f"model.rope_scaling.mscale={y.mscale} with model.rope_scaling.mscale_all_dim=0: transformers then "
            "ignores mscale (Megatron does not). Fix: mscale=1, or a nonzero mscale_all_dim."
        )
    if cfg.trainer.backend is TrainerBackend.megatron:
        family = ModelFamily(cfg.model.family)
        if family is not ModelFamily.deepseek_v3:
            errors.append(
                f"model.rope_scaling.type=yarn with trainer=megatron and model.family={family.value}: "
                "Megatron applies YaRN in MLA (deepseek_v3) only. Fix: trainer=native, or type=none."
            )
    return errors


def _topology_errors(cfg: TrainConfig) -> list[str]:
    t, par, r, m, errors = cfg.topology, cfg.topology.parallel, cfg.rollout, cfg.model, []
    if cfg.trainer.backend is TrainerBackend.megatron and par.tp > 1 and not par.sequence_parallel:
        errors.append(
            f"topology.parallel.tp={par.tp} with sequence_parallel=false and trainer=megatron: megatron-core's MoE "
            "layer refuses to train with tensor parallelism but no sequence parallelism (at the first update). "
            "Fix: topology.parallel.sequence_parallel=true."
        )
    if t.device is Device.cpu:
        if t.trainer_gpus or t.rollout_gpus or t.gpus_per_node:
            errors.append(
                f"topology.device=cpu with topology.trainer_gpus={t.trainer_gpus}, rollout_gpus="
                f"{t.rollout_gpus}, gpus_per_node={t.gpus_per_node}: a CPU topology has no GPUs. "
                "Fix: set them to 0 or pick topology=1gpu/8gpu/256gpu."
            )
        if cfg.trainer.backend is TrainerBackend.megatron:
            # Megatron ranks are Ray actors on the CPU too (gloo): any layout the experts divide,
            # pipeline stages included; the trainer refuses what it cannot run there (cp) when it starts.
            if Precision(cfg.precision.name) in (Precision.fp8_blockwise, Precision.mxfp8):
                errors.append(
                    f"precision={Precision(cfg.precision.name).value} with trainer=megatron on topology.device=cpu: "
                    "Megatron's FP8 runs through Transformer Engine, which needs a GPU. "
                    "Fix: precision=bf16 or int4_qat, or a GPU topology."
                )
            non_pp = par.tp * par.cp * (par.dp or 1)
            if non_pp % (par.ep * par.etp):
                errors.append(
                    f"topology.parallel: ep*etp = {par.ep}*{par.etp} must divide tp*cp*dp = {non_pp} "
                    "(experts are sharded over the non-pipeline ranks; on the CPU dp=null means 1)."
                )
            if m.num_experts % par.ep:
                errors.append(
                    f"topology.parallel.ep={par.ep} does not divide model.num_experts={m.num_experts}."
                )
            errors += _pipeline_errors(cfg)
        elif par.tp * par.pp * par.cp * par.ep * par.etp != 1:
            errors.append(
                "topology.parallel sizes must all be 1 on topology.device=cpu with "
                f"trainer={cfg.trainer.backend.value} (one trainer process). Fix: trainer=megatron for a parallel layout."
            )
        return errors
    total = t.num_nodes * t.gpus_per_node
    if t.placement is Placement.colocated:
        if not (t.trainer_gpus == t.rollout_gpus == total):
            errors.append(
                f"topology.placement=colocated needs topology.trainer_gpus == topology.rollout_gpus == "
                f"num_nodes*gpus_per_node ({t.num_nodes}*{t.gpus_per_node}={total}); got "
                f"{t.trainer_gpus} and {t.rollout_gpus}. Fix: set both to {total}."
            )
    elif t.trainer_gpus + t.rollout_gpus != total:
        errors.append(
            f"topology.placement=split: topology.trainer_gpus ({t.trainer_gpus}) + topology.rollout_gpus "
            f"({t.rollout_gpus}) must equal num_nodes*gpus_per_node = {total}."
        )
    model_par = par.tp * par.pp * par.cp
    if par.dp is None and t.trainer_gpus % model_par:
        errors.append(
            f"topology.trainer_gpus={t.trainer_gpus} is not divisible by tp*pp*cp = {par.tp}*{par.pp}*{par.cp} "
            f"= {model_par}. Fix: change topology.parallel sizes."
        )
    elif model_par * trainer_dp(cfg) != t.trainer_gpus:
        errors.append(
            f"topology.parallel: tp*pp*cp*dp = {par.tp}*{par.pp}*{par.cp}*{trainer_dp(cfg)} = "
            f"{model_par * trainer_dp(cfg)} != topology.trainer_gpus={t.trainer_gpus}. Fix: topology.parallel.dp=null "
            "(derived) or sizes whose product is the trainer GPUs."
        )
    if m.num_experts % par.ep:
        errors.append(
            f"topology.parallel.ep={par.ep} does not divide model.num_experts={m.num_experts}. "
            f"Fix: an EP in {{{', '.join(str(e) for e in range(1, 65) if m.num_experts % e == 0)}}}."
        )
    non_pp = par.tp * par.cp * trainer_dp(cfg)
    if non_pp % (par.ep * par.etp):
        errors.append(
            f"topology.parallel: ep*etp = {par.ep}*{par.etp} must divide tp*cp*dp = {non_pp} "
            "(experts are sharded over the non-pipeline ranks)."
        )
    errors += _pipeline_errors(cfg)
    if t.rollout_gpus % r.gpus_per_engine:
        errors.append(
            f"topology.rollout_gpus={t.rollout_gpus} is not a multiple of rollout.gpus_per_engine="
            f"{r.gpus_per_engine}: engines x GPUs per engine must equal the rollout GPUs."
        )
    if (
        t.device is not Device.cpu
        and r.num_engines is not None
        and r.num_engines * r.gpus_per_engine > t.rollout_gpus
    ):
        errors.append(
            f"rollout.num_engines={r.num_engines} x rollout.gpus_per_engine={r.gpus_per_engine} = "
            f"{r.num_engines * r.gpus_per_engine} GPUs, but topology.rollout_gpus={t.rollout_gpus}. Fix: at most "
            f"{t.rollout_gpus // r.gpus_per_engine} engines, or leave rollout.num_engines unset."
        )
    engine_tp = r.tp_size or r.gpus_per_engine
    if engine_tp > r.gpus_per_engine or r.gpus_per_engine % engine_tp:
        errors.append(f"rollout.tp_size={engine_tp} must divide rollout.gpus_per_engine={r.gpus_per_engine}.")
    if engine_tp % r.dp_size or engine_tp % r.ep_size:
        errors.append(
            f"rollout.dp_size={r.dp_size} and rollout.ep_size={r.ep_size} must divide the engine TP size {engine_tp}."
        )
    if m.num_experts % r.ep_size:
        errors.append(f"rollout.ep_size={r.ep_size} does not divide model.num_experts={m.num_experts}.")
    return errors


def _placement_errors(cfg: TrainConfig) -> list[str]:
    """What the placement planner refuses for a topology that passed `_topology_errors` (an engine
    that would straddle two nodes, one wider than a node not on whole nodes, a user env entry for a
    variable the plan sets): reported with the other errors before anything starts, in the
    planner's own words (`skyq.launch.plan`, which raises the same again as a backstop)."""
    from skyq.launch.plan import PlanError, plan_placement

    try:
        plan_placement(topology=cfg.topology, rollout=cfg.rollout, trainer=cfg.trainer)
    except PlanError as exc:
        return [str(exc)]
    return []


def _pipeline_errors(cfg: TrainConfig) -> list[str]:
    par, layers = cfg.topology.parallel, cfg.model.num_layers
    first, last = par.first_stage_layers, par.last_stage_layers
    if par.pp == 1:
        return (
            ["topology.parallel.first_stage_layers/last_stage_layers need topology.parallel.pp > 1."]
            if first is not None or last is not None
            else []
        )
    middle_stages = par.pp - (first is not None) - (last is not None)
    rest = layers - (first or 0) - (last or 0)
    # megatron-core's rule: the layers left over split evenly over the stages left over (pp=2 with
    # both counts set leaves none of either)
    if rest < 0 or bool(rest) != bool(middle_stages) or (middle_stages and rest % middle_stages):
        return [
            f"topology.parallel: model.num_layers={layers} minus first_stage_layers={first} and "
            f"last_stage_layers={last} leaves {rest} layers for {middle_stages} pipeline stages "
            f"(pp={par.pp}), not an even split. Fix: adjust the stage layer counts or pp."
        ]
    return []


def _length_errors(cfg: TrainConfig) -> list[str]:
    task, m = cfg.task, cfg.model
    total = task.max_prompt_length + task.max_response_length
    errors = []
    if total > m.max_position_embeddings:
        errors.append(
            f"task.max_prompt_length + task.max_response_length = {task.max_prompt_length} + "
            f"{task.max_response_length} = {total} exceeds model.max_position_embeddings="
            f"{m.max_position_embeddings}. Fix: shorten the lengths."
        )
    if task.image_key is not None and task.max_image_tokens <= 0:
        errors.append(
            f"task.image_key={task.image_key} needs task.max_image_tokens > 0 (the image-token budget)."
        )
    if task.image_key is not None and m.vision_num_layers == 0:
        errors.append(
            f"task.image_key={task.image_key} (a multimodal task) with model={m.name}, which has no vision "
            "tower (model.vision_num_layers=0). Fix: a multimodal model or a text task."
        )
    return errors


def _algorithm_errors(cfg: TrainConfig) -> list[str]:
    a, errors = cfg.algorithm, []
    if a.group_size >= 2 and a.global_batch_size >= 1 and a.global_batch_size % a.group_size:
        errors.append(
            f"algorithm.global_batch_size={a.global_batch_size} is not a multiple of algorithm.group_size="
            f"{a.group_size} (the batch is whole groups)."
        )
    if a.kl_coef > 0 and cfg.checkpoint.ref_load is None and cfg.model.name != "tiny_moe":
        errors.append(
            f"algorithm.kl_coef={a.kl_coef} needs a reference model: set checkpoint.ref_load (a BF16 checkpoint)."
        )
    if a.max_mismatch < 0 or a.mismatch_patience < 1:
        errors.append(
            f"algorithm.max_mismatch={a.max_mismatch}, mismatch_patience={a.mismatch_patience}: need "
            "max_mismatch >= 0 (0 turns the guard off) and mismatch_patience >= 1."
        )
    if not 0 < a.is_low < 1 < a.is_high or a.is_cap < 1:
        errors.append(
            f"algorithm.is_low={a.is_low}, is_high={a.is_high}, is_cap={a.is_cap}: need 0 < is_low < 1 < is_high "
            "and is_cap >= 1."
        )
    return errors
