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
                (
                    "attention q/o heads",
                    "model.num_attention_heads*model.v_head_dim",
                    heads * model.v_head_dim,
                    False,
                )
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
    *,
    model: ModelConfig,
    precision: PrecisionConfig,
    parallel: ParallelConfig,
    rollout: RolloutConfig,
    gpu: bool,
) -> list[ShardCheck]:
    """Every divisibility row for this run (empty for bf16).

    Group formats (MXFP8 1x32, INT4 groups of G) need K divisible by the group on every run; sharded
    dims are checked on GPU topologies. FP8 blockwise handles an unsharded edge block (zero padding),
    so only real shards (count > 1) must be multiples of the block.
    """
    div = _divisor(precision)
    if div is None:
        return []
    divisor, divisor_key = div
    scope = _scope(precision)
    checks = []
    if precision.name is not Precision.fp8_blockwise:
        for tensor, key, size in _k_dims(model, scope):
            checks.append(ShardCheck("format", tensor, key, size, 1, "unsharded", divisor, divisor_key))
    if not gpu:
        return checks
    engine_tp = rollout.tp_size or rollout.gpus_per_engine
    expert_tp = max(engine_tp // rollout.ep_size, 1)
    attn_tp = max(engine_tp // rollout.dp_size, 1)
    for tensor, key, size, is_expert in _dims(model, scope):
        if is_expert:
            engine = (expert_tp, "rollout.tp_size / rollout.ep_size")
            trainer = (parallel.etp, "topology.parallel.etp")
        else:
            engine = (attn_tp, "rollout.tp_size / rollout.dp_size")
            trainer = (parallel.tp, "topology.parallel.tp")
        for side, (shards, shards_key) in (("engine", engine), ("trainer", trainer)):
            if shards > 1 or precision.name is not Precision.fp8_blockwise:
                checks.append(ShardCheck(side, tensor, key, size, shards, shards_key, divisor, divisor_key))
    return checks


def _k_dims(model: ModelConfig, scope: QuantScope) -> list[tuple[str, str, int]]:
    """The input (K) dims of the quantized linears: a group along K must divide each."""
    dims = [
        ("routed-expert gate/up K", "model.hidden_size", model.hidden_size),
        ("routed-expert down K", "model.moe_intermediate_size", model.moe_intermediate_size),
    ]
    if scope is QuantScope.all_linear and not model.kv_lora_rank:
        dims.append(
            (
                "attention o_proj K",
                "model.num_attention_heads*model.head_dim",
                model.num_attention_heads * model.head_dim,
            )
        )
    return dims


def shard_errors(checks: list[ShardCheck]) -> list[str]:
    errors = []
    for c in checks:
        if c.ok:
            continue
        valid = ", ".join(map(str, c.valid_shard_counts()))
        if c.shards == 1:
            errors.append(
                f"{c.tensor}: {c.arithmetic()}. Fix: a {c.divisor_key} that divides {c.dim} "
                f"(group formats need K % group == 0)."
            )
            continue
        fix = f"use a shard count in {{{valid}}}" if valid else f"change {c.divisor_key}"
        if c.tensor == "routed-expert width":
            fix += " or shard experts with EP instead of TP (rollout.ep_size / topology.parallel.ep)"
        errors.append(f"{c.side} shard of {c.tensor}: {c.arithmetic()}. Fix: {fix}.")
    return errors
