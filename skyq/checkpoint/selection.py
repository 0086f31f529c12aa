"""Which tensors of a checkpoint a precision quantizes: the layout's role of every tensor name.

Converters see only tensor names; the layout of the checkpoint's family (from config.json) gives
each name its role, and the precision's strategy (`skyq.quant.strategies`) says which are quantized
- the same rule the trainer's fake-quant, the plan and the weight sync follow. A name the layout does not know is an error
naming it: a converter must never guess what an unknown tensor is.

Everything here reads shard headers only, so a converter runs it before its first write: a tensor
of the wrong dtype or rank, or a checkpoint that does not match the plan of its own config.json,
is refused with nothing written (the plan's `quantization_config` would otherwise describe
tensors the shards do not hold).
"""

from __future__ import annotations

from dataclasses import dataclass

from skyq.checkpoint.errors import CheckpointError
from skyq.checkpoint.reader import TensorInfo
from skyq.config.schema import ModelConfig, PrecisionConfig
from skyq.quant.layouts import LINEAR_ROLES, LayoutError, Role, get_layout
from skyq.quant.plan import QuantPlan, build_plan
from skyq.quant.strategies import get_strategy

UNQUANTIZED_DTYPES = ("BF16", "F16", "F32")
"""safetensors dtypes a quantizing converter reads: every tensor of an unquantized HF release."""


@dataclass(frozen=True)
class CheckpointSelection:
    roles: dict[str, Role]
    quantized: frozenset[str]
    """2-D `.weight` tensors whose role the scope quantizes."""
    kept_modules: tuple[str, ...]
    """Sorted modules owning a 2-D `.weight` that stays unquantized (engines' skip/ignore list)."""


def select(
    tensors: dict[str, TensorInfo], model_cfg: ModelConfig, precision_cfg: PrecisionConfig
) -> CheckpointSelection:
    """Roles of every tensor and the set the precision quantizes; CheckpointError naming an unknown
    tensor, a tensor that is not floating point, or a weight of a quantized role that is not 2-D."""
    layout = get_layout(model_cfg.family)
    roles: dict[str, Role] = {}
    for name in sorted(tensors):
        try:
            roles[name] = layout.role(name, model_cfg)
        except LayoutError as e:
            raise CheckpointError(
                f"tensor {name!r} in {tensors[name].shard}: {e} (model config derived from config.json)"
            ) from e
    strategy = get_strategy(precision_cfg)
    _check_dtypes_and_ranks(tensors, roles, strategy.quantizes)
    linear = {n for n, info in tensors.items() if n.endswith(".weight") and len(info.shape) == 2}
    quantized = frozenset(n for n in linear if strategy.quantizes_param(n, tensors[n].shape, roles[n]))
    kept = tuple(sorted({layout.module_name(n) for n in linear - quantized}))
    return CheckpointSelection(roles=roles, quantized=quantized, kept_modules=kept)


def _check_dtypes_and_ranks(tensors: dict[str, TensorInfo], roles: dict[str, Role], quantizes) -> None:
    """Every tensor floating point (an int64 or bool tensor would be copied or fail mid-run), and
    every `.weight` of a quantized role exactly 2-D: a flattened or stacked one would silently stay
    unquantized while the written config says its role is quantized."""
    for name in sorted(tensors):
        info = tensors[name]
        if info.dtype not in UNQUANTIZED_DTYPES:
            raise CheckpointError(
                f"tensor {name!r} in {info.shard} is {info.dtype} (shape {list(info.shape)}): an unquantized "
                f"checkpoint holds only {'/'.join(UNQUANTIZED_DTYPES)} tensors; re-export the model "
                "(e.g. save_pretrained in bf16)"
            )
        if quantizes(roles[name]) and name.endswith(".weight") and len(info.shape) != 2:
            raise CheckpointError(
                f"tensor {name!r} in {info.shard} has shape {list(info.shape)}: a {roles[name].value} "
                "weight is quantized as one 2-D [N, K] matrix; re-export the checkpoint with unflattened, "
                "per-expert 2-D weights (as transformers' save_pretrained writes them)"
            )


def checked_plan(
    model_cfg: ModelConfig,
    precision_cfg: PrecisionConfig,
    selection: CheckpointSelection,
    tensors: dict[str, TensorInfo],
) -> QuantPlan:
    """The plan of `model_cfg` under `precision_cfg`, after checking that it quantizes exactly the
    checkpoint's selected tensors with the checkpoint's shapes, and knows every linear kept unquantized
    (so the strategy's `quantization_config(plan)` describes what the shards hold)."""
    plan = build_plan(model_cfg, precision_cfg)
    planned = {p.name for p in plan if p.quantized}
    differ = sorted(planned ^ selection.quantized)
    if differ:
        side = "the checkpoint lacks" if differ[0] in planned else "the config.json plan does not quantize"
        raise CheckpointError(
            f"tensor {differ[0]!r}: {side} it ({len(differ)} quantized tensor(s) differ between config.json "
            "and the shards); the checkpoint does not match its config"
        )
    for name in sorted(selection.quantized):
        want, got = plan[name].shape, tuple(tensors[name].shape)
        if got != want:
            raise CheckpointError(
                f"tensor {name!r} in {tensors[name].shard} has shape {list(got)}, config.json implies "
                f"{list(want)}; the checkpoint does not match its config"
            )
    for name in sorted(n for n in tensors if n not in selection.quantized):
        if (
            selection.roles[name] in LINEAR_ROLES
            and name.endswith(".weight")
            and len(tensors[name].shape) == 2
            and name not in plan
        ):
            raise CheckpointError(
                f"tensor {name!r} in {tensors[name].shard} stays unquantized but the plan of config.json "
                "does not hold it (the engine's ignore list would miss it and look for its quantized form); "
                "the checkpoint does not match its config"
            )
    return plan
