"""Which schema keys each backend reads: the one table that keeps "accepted" meaning "honoured".

A key is either read whatever the backends (`UNIVERSAL`: the run loop, the quantization plan, the
placement, the logger) or by the backends that list it in `READS`. A key the chosen trainer and
rollout backends do not read, set to anything but its schema default, is refused by `validate`,
naming the backend that does read it: before this table, `trainer.recompute.*` or
`precision.persistent_fp8_params` were accepted on the embedded pair and changed nothing.

A backend declares its keys here (an entry per backend, patterns `a.b.c` or `a.b.*`); a project-rule
test (tests/config/test_project_rules.py) fails when a schema field is neither universal nor read
by some backend, or when a pattern names no schema field. `AVAILABLE` lists the backends this build
of skyq runs; the others' entries declare what they will read when they land.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from enum import Enum
from typing import Any, Union

from skyq.config import schema
from skyq.config.enums import RolloutBackend, TrainerBackend

Backend = Union[TrainerBackend, RolloutBackend]

UNIVERSAL: tuple[str, ...] = (
    "config_version",
    "seed",
    "dry_run",
    "simulate",
    "resume",
    "output_root",
    # precision.* but persistent_fp8_params: read through the quantization strategy and plan
    "precision.name",
    "precision.fp8_recipe",
    "precision.scale_format",
    "precision.block_size",
    "precision.activation_tile",
    "precision.fp8_targets",
    "precision.mxfp8_targets",
    "precision.int4_group_size",
    "precision.int4_grid",
    "precision.qat_scope",
    "precision.emulate",
    "model.*",  # the plan, the checkpoint checks and the tiny-checkpoint builder
    "topology.name",
    "topology.device",
    "topology.num_nodes",
    "topology.gpus_per_node",
    "topology.placement",
    "topology.trainer_gpus",
    "topology.rollout_gpus",
    "topology.placement_timeout_s",
    "algorithm.*",
    "task.name",
    "task.dataset",
    "task.reward",
    "task.prompt_key",
    "task.label_key",
    "task.apply_chat_template",
    "task.max_prompt_length",
    "task.max_response_length",
    "task.arith_op",
    "task.eval.*",
    "rollout.backend",
    "rollout.temperature",
    "rollout.top_p",
    "rollout.env",
    "rollout.num_engines",
    "rollout.weight_sync.transport",
    "rollout.weight_sync.bucket_bytes",
    "rollout.weight_sync.timeout_s",
    "rollout.weight_sync.verify_checksum",
    "rollout.weight_sync.worker_call_timeout_s",
    "trainer.backend",
    "trainer.env",
    "trainer.optimizer.weight_decay",
    "trainer.optimizer.adam_beta1",
    "trainer.optimizer.adam_beta2",
    "trainer.optimizer.adam_eps",
    "trainer.optimizer.grad_clip",
    "trainer.optimizer.lr_warmup_steps",
    "logger.*",
    "checkpoint.hf_checkpoint",
    "checkpoint.save",
    "checkpoint.save_interval",
    "checkpoint.async_save",
)
"""Keys read whatever the trainer and rollout backends."""

READS: dict[Backend, tuple[str, ...]] = {
    TrainerBackend.torch: (
        "trainer.micro_batch_size",
        "trainer.compute_dtype",
        "trainer.fp8_gemm",
        "checkpoint.cache_dir",
        # Multimodal tasks: the native trainer scores each row with its images (vision tower + projector).
        "task.image_key",
        "task.max_image_tokens",
    ),
    TrainerBackend.megatron: (
        "topology.parallel.*",
        "trainer.compute_dtype",
        "trainer.micro_batch_size",
        "trainer.optimizer.cpu_offload",
        "trainer.optimizer.overlap_cpu_offload",
        "trainer.optimizer.precision_aware",
        "trainer.recompute.*",
        "trainer.moe_token_dispatcher",
        "trainer.deepep_max_dispatch_tokens",
        "precision.persistent_fp8_params",
        "checkpoint.load",
        "checkpoint.ref_load",
    ),
    RolloutBackend.embedded: (
        "rollout.cuda_graphs",
        "rollout.fp8_codes_decode",
        "checkpoint.rollout_checkpoint",
        # The embedded engine prefills a prompt's images; vLLM is not given them yet, so it refuses them.
        "task.image_key",
        "task.max_image_tokens",
    ),
    RolloutBackend.vllm: (
        "rollout.gpus_per_engine",
        "rollout.tp_size",
        "rollout.dp_size",
        "rollout.ep_size",
        "rollout.gpu_memory_fraction",
        "rollout.max_model_len",
        "rollout.max_num_seqs",
        "rollout.kv_cache_bytes",
        "rollout.enforce_eager",
        "rollout.engine_core_process",
        "rollout.weight_sync.mode",
        "checkpoint.rollout_checkpoint",
    ),
}
"""Keys each backend reads on top of `UNIVERSAL` (a new backend adds its entry here)."""

BOTH_SIDES: tuple[str, ...] = ("task.image_key", "task.max_image_tokens")
"""Keys that a runnable pair (both backends `AVAILABLE`) must read on both sides (the images go to the
engine and to the trainer): one reader alone would train on prompts the engine sampled without their
images, or the reverse. A pair with a planned backend is checked against its declarations as any key."""

AVAILABLE: frozenset[Backend] = frozenset(
    {TrainerBackend.torch, TrainerBackend.megatron, RolloutBackend.embedded, RolloutBackend.vllm}
)
"""Backends this build of skyq runs (the others are planned: their keys are declared, not yet read)."""


def matches(pattern: str, key: str) -> bool:
    """`a.b.*` covers every key under `a.b`; any other pattern is one exact key."""
    if pattern.endswith(".*"):
        return key.startswith(pattern[:-1])
    return key == pattern


def readers(key: str) -> list[Backend]:
    """The backends that read `key` (empty for a universal key or one nothing reads)."""
    return [b for b, patterns in READS.items() if any(matches(p, key) for p in patterns)]


def is_universal(key: str) -> bool:
    return any(matches(p, key) for p in UNIVERSAL)


def leaf_fields(cls: type = schema.TrainConfig, prefix: str = "") -> Iterator[tuple[str, dataclasses.Field]]:
    """Every (full key, field) of the schema below `cls` that is not itself a section."""
    for f in dataclasses.fields(cls):
        sub = _SECTIONS.get(f.type if isinstance(f.type, str) else getattr(f.type, "__name__", ""))
        if sub is not None:
            yield from leaf_fields(sub, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", f


_SECTIONS: dict[str, type] = {
    name: obj for name, obj in vars(schema).items() if isinstance(obj, type) and dataclasses.is_dataclass(obj)
}


def _default(f: dataclasses.Field) -> Any:
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return f.default


def _value(cfg: schema.TrainConfig, key: str) -> Any:
    node: Any = cfg
    for part in key.split("."):
        node = getattr(node, part)
    return node


def _name(backend: Backend) -> str:
    kind = "trainer" if isinstance(backend, TrainerBackend) else "rollout"
    return f"{kind}={backend.value}" + ("" if backend in AVAILABLE else " (not in this build yet)")


def ignored_setting_errors(cfg: schema.TrainConfig) -> list[str]:
    """Every key set away from its default that neither chosen backend reads (a `BOTH_SIDES` key on a
    runnable pair: that not both read), naming who reads it."""
    chosen = (cfg.trainer.backend, cfg.rollout.backend)
    errors = []
    for key, f in leaf_fields():
        if is_universal(key):
            continue
        who = readers(key)
        value = _value(cfg, key)
        if value == _default(f):
            continue
        if key in BOTH_SIDES and all(b in AVAILABLE for b in chosen):
            if all(b in who for b in chosen):
                continue
        elif any(b in chosen for b in who):
            continue
        errors.append(
            f"{key}={_shown(value)} is read only by {' / '.join(_name(b) for b in who) or 'no backend'}; "
            f"trainer={cfg.trainer.backend.value} rollout={cfg.rollout.backend.value} would ignore it. "
            f"Fix: {key}={_shown(_default(f))} (its default), or the backend that reads it."
        )
    return errors


def _shown(value: Any) -> str:
    """A value as it is written on the command line (`null`, enum values bare)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value.value if isinstance(value, Enum) else value)
