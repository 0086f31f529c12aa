"""Shard-divisibility rules of FORMATS.md, checked at config time with the arithmetic shown.

Each check is one (what, dim, shard count, divisor) row, so the dry run can print the table and a
failure can say exactly which key to change.
"""

from __future__ import annotations

from dataclasses import dataclass

from skyq.config.enums import Precision, QuantScope
from skyq.config.schema import ModelConfig, ParallelConfig, PrecisionConfig, RolloutConfig


@dataclass(frozen=True)
class ShardCheck:
    side: str
    """`engine` or `trainer`."""
    tensor: str
    """Which weights (e.g. `routed-expert width`)."""
    dim_key: str
    """Config key of the dimension."""
    dim: int
    """Full size of the dimension."""
    shards: int
    """Number of shards the dimension is split into."""
    shards_key: str
    """Config key(s) that set the shard count."""
    divisor: int
    """What each shard must be a multiple of."""
    divisor_key: str
    """Config key of the divisor."""

    @property
    def ok(self) -> bool:
        return self.dim % self.shards == 0 and (self.dim // self.shards) % self.divisor == 0

    def arithmetic(self) -> str:
        if self.dim % self.shards:
            return f"{self.dim_key}={self.dim} / {self.shards} ({self.shards_key}) is not an integer"
        per = self.dim // self.shards
        verdict = "ok" if per % self.divisor == 0 else "NOT a multiple of"
        return (
            f"{self.dim_key}={self.dim} / {self.shards} ({self.shards_key}) = {per}, "
            f"{verdict} {self.divisor} ({self.divisor_key})"
        )

    def valid_shard_counts(self, limit: int = 64) -> list[int]:
        return [t for t in range(1, limit + 1) if self.dim % t == 0 and (self.dim // t) % self.divisor == 0]


def _divisor(precision: PrecisionConfig) -> tuple[int, str] | None:
    if precision.name is Precision.fp8_blockwise:
        return int(precision.block_size[0]), "precision.block_size"
    if precision.name is Precision.mxfp8:
        return 32, "MXFP8 block (32)"
    if precision.name is Precision.int4_qat:
        return int(precision.int4_group_size), "precision.int4_group_size"
    return None


def _scope(precision: PrecisionConfig) -> QuantScope:
    return {
        Precision.fp8_blockwise: precision.fp8_targets,
        Precision.mxfp8: precision.mxfp8_targets,
        Precision.int4_qat: precision.qat_scope,
    }.get(precision.name, QuantScope.routed_experts)


def _dims(model: ModelConfig, scope: QuantScope) -> list[tuple[str, str, int, bool]]:
    """(tensor, dim key, size, is_expert) for every sharded dim the precision quantizes."""
    dims = [("routed-expert width", "model.moe_intermediate_size", model.moe_intermediate_size, True)]
    if scope is QuantScope.all_linear:
        if model.kv_lora_rank:  # MLA: the per-head projections are the sharded ones
            heads = model.num_attention_heads
            dims.append(
                ("attention q/o heads", "model.num_attention_heads*model.v_head_dim", heads * model.v_head_dim, False)
            )
        else:
            dims.append(
                (
                    "attention q/o width",
                    "model.num_attention_heads*model.head_dim",
                    model.num_attention_heads * model.head_dim,
                    False,
                )
            )
        if model.num_shared_experts:
            dims.append(
                (
                    "shared-expert width",
                    "model.num_shared_experts*model.moe_intermediate_size",
                    model.num_shared_experts * model.moe_intermediate_size,
                    False,
                )
            )
        if model.first_k_dense_replace:
            dims.append(("dense MLP width", "model.intermediate_size", model.intermediate_size, False))
    return dims


def shard_checks(
    *, model: ModelConfig, precision: PrecisionConfig, parallel: ParallelConfig, rollout: RolloutConfig, gpu: bool
) -> list[ShardCheck]:
    """Every shard-divisibility row for this run (empty for bf16 or a CPU run)."""
    div = _divisor(precision)
    if div is None or not gpu:
        return []
    divisor, divisor_key = div
    engine_tp = rollout.tp_size or rollout.gpus_per_engine
    expert_tp = max(engine_tp // rollout.ep_size, 1)
    attn_tp = max(engine_tp // rollout.dp_size, 1)
    checks = []
    for tensor, key, size, is_expert in _dims(model, _scope(precision)):
        if is_expert:
            engine = (expert_tp, "rollout.tp_size / rollout.ep_size")
            trainer = (parallel.etp, "topology.parallel.etp")
        else:
            engine = (attn_tp, "rollout.tp_size / rollout.dp_size")
            trainer = (parallel.tp, "topology.parallel.tp")
        checks.append(ShardCheck("engine", tensor, key, size, engine[0], engine[1], divisor, divisor_key))
        checks.append(ShardCheck("trainer", tensor, key, size, trainer[0], trainer[1], divisor, divisor_key))
    return checks


def shard_errors(checks: list[ShardCheck]) -> list[str]:
    errors = []
    for c in checks:
        if c.ok:
            continue
        valid = ", ".join(map(str, c.valid_shard_counts()))
        fix = f"use a shard count in {{{valid}}}" if valid else "no shard count works"
        if c.tensor == "routed-expert width":
            fix += " or shard experts with EP instead of TP (rollout.ep_size / topology.parallel.ep)"
        errors.append(f"{c.side} shard of {c.tensor}: {c.arithmetic()}. Fix: {fix}.")
    return errors
