"""The per-parameter quantization plan: one answer, from the config alone, for every tensor.

`build_plan(model_cfg, precision_cfg)` walks the layout's HF parameter list and asks the strategy,
for each tensor, whether it is quantized and what it becomes on the wire. The trainer (fake-quant
scope), the converters (checkpoint contents and ignore list) and the rollout engine (what it expects
to receive) each build or load the same plan; `diff` says where two of them disagree.

The plan is pure Python (dtypes by name, see `dtype_names`; shapes as tuples): building, printing
and comparing one imports no torch, so a dry run answers without loading it. `.dtype` of a tensor's
entry is the torch dtype, for the code that makes tensors.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from skyq.config.enums import ModelFamily, Precision
from skyq.config.schema import ModelConfig, PrecisionConfig
from skyq.quant import dtype_names, patterns
from skyq.quant.layouts import LINEAR_ROLES, Role, get_layout
from skyq.quant.strategies import WireSpec, get_strategy

if TYPE_CHECKING:
    import torch

PLAN_VERSION = 1
_DIFF_LIMIT = 20
_DIFF_FIELDS = ("role", "shape", "dtype", "quantized", "format", "block", "bytes", "wire")
_JSON_FIELDS = ["name", "role", "shape", "dtype", "quantized", "format", "block", "bytes", "wire_template"]


class PlanError(ValueError):
    """A plan that cannot be read, or a lookup of a tensor the plan does not hold."""


class ParamPlan(NamedTuple):
    """What happens to one HF tensor. (A NamedTuple: Kimi-K2.6 has ~70k of them.)"""

    name: str
    role: Role
    shape: tuple[int, ...]
    dtype_name: str
    """The unquantized (HF bf16 checkpoint) dtype, by name (`torch.bfloat16`); `dtype` is the torch dtype."""
    quantized: bool
    format: str | None
    """Wire format of a quantized weight (`fp8_blockwise`, `mxfp8`, `int4`), None when unquantized."""
    block: tuple[int, ...] | None
    """Quantization block (rows, cols) or group (1, G) of a quantized weight."""
    bytes: int
    """Bytes of the wire tensors."""
    wire_template: tuple[tuple[str, tuple[int, ...], str], ...]
    """(suffix, shape, dtype name) of each wire tensor; shared by all tensors of one shape and role,
    so a 70k-tensor plan does not hold 200k name strings it can derive."""

    @property
    def dtype(self) -> torch.dtype:
        """The unquantized dtype as a torch dtype (imports torch)."""
        return dtype_names.torch_dtype(self.dtype_name)

    @property
    def wire(self) -> tuple[WireSpec, ...]:
        """The wire tensors: (name, shape, dtype), named as FORMATS.md says."""
        stem = self.name.removesuffix("weight") if self.quantized else self.name
        return tuple(WireSpec(stem + suffix, shape, dtype) for suffix, shape, dtype in self.wire_template)

    @property
    def bf16_bytes(self) -> int:
        return math.prod(self.shape) * dtype_names.ITEMSIZE[self.dtype_name]


def _is_linear_weight(p: ParamPlan) -> bool:
    return p.role in LINEAR_ROLES and p.name.endswith(".weight") and len(p.shape) == 2


@dataclass
class QuantPlan:
    """Every tensor of one model under one precision, in the layout's deterministic order."""

    family: ModelFamily
    precision: Precision
    model_name: str
    settings: dict[str, object]
    """The strategy's wire settings (block, grid, scale format)."""
    params: tuple[ParamPlan, ...]
    _index: dict[str, ParamPlan] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __len__(self) -> int:
        return len(self.params)

    def __iter__(self) -> Iterator[ParamPlan]:
        return iter(self.params)

    def __contains__(self, name: object) -> bool:
        return name in self._lookup()

    def __getitem__(self, name: str) -> ParamPlan:
        try:
            return self._lookup()[name]
        except KeyError:
            raise PlanError(
                f"{name}: not a tensor of the {self.model_name} / {self.precision.value} plan"
            ) from None

    def _lookup(self) -> dict[str, ParamPlan]:
        if not self._index:
            self._index.update((p.name, p) for p in self.params)
        return self._index

    # sizes and modules ---------------------------------------------------------------------------

    @property
    def wire_bytes(self) -> int:
        """Bytes of everything sent per full sync (quantized weights with their scales, the rest bf16)."""
        return sum(p.bytes for p in self.params)

    @property
    def bf16_bytes(self) -> int:
        """Bytes of the same tensors in the unquantized HF checkpoint."""
        return sum(p.bf16_bytes for p in self.params)

    def quantized_modules(self) -> list[str]:
        """Sorted module names whose weight is quantized."""
        return sorted({p.name.removesuffix(".weight") for p in self.params if p.quantized})

    def unquantized_linear_modules(self) -> list[str]:
        """Sorted names of linear(-like) modules kept unquantized: router, lm_head, bf16 projections, vision."""
        return sorted(
            {p.name.removesuffix(".weight") for p in self.params if not p.quantized and _is_linear_weight(p)}
        )

    def ignore_list(self) -> list[str]:
        """compressed-tensors `ignore` for the unquantized linear modules: anchored `re:` patterns per
        module template, exact names where a template also holds quantized modules."""
        return patterns.compact_ignore_list(self.unquantized_linear_modules(), self.quantized_modules())

    def check_ignore_list(self, ignore: list[str]) -> list[str]:
        """Disagreements between an ignore list (e.g. a checkpoint's) and this plan; empty if none."""
        return patterns.ignore_disagreements(
            ignore, self.quantized_modules(), self.unquantized_linear_modules()
        )

    # reports -----------------------------------------------------------------------------------------

    def counts_by_role(self) -> dict[Role, tuple[int, int]]:
        """role -> (tensors, quantized tensors), for roles present in the model."""
        counts: dict[Role, list[int]] = {}
        for p in self.params:
            entry = counts.setdefault(p.role, [0, 0])
            entry[0] += 1
            entry[1] += p.quantized
        return {role: (total, quantized) for role, (total, quantized) in counts.items()}

    def summary(self) -> str:
        """A table of tensors per role (quantized / kept) and the wire size against bf16."""
        lines = [
            f"quantization plan: {self.model_name} ({self.family.value}), precision {self.precision.value}"
        ]
        if self.settings:
            lines.append("  " + ", ".join(f"{k}={v}" for k, v in self.settings.items()))
        lines.append(f"  {'role':<15}{'tensors':>10}{'quantized':>11}{'kept':>9}  format")
        fmt = {p.role: p.format for p in self.params if p.quantized}
        for role, (total, quantized) in self.counts_by_role().items():
            lines.append(
                f"  {role.value:<15}{total:>10}{quantized:>11}{total - quantized:>9}  {fmt.get(role) or 'bf16'}"
            )
        n_q = sum(p.quantized for p in self.params)
        lines.append(f"  {'total':<15}{len(self.params):>10}{n_q:>11}{len(self.params) - n_q:>9}")
        ratio = self.wire_bytes / self.bf16_bytes if self.bf16_bytes else 1.0
        lines.append(
            f"  wire {self.wire_bytes / 2**30:.3f} GiB vs bf16 {self.bf16_bytes / 2**30:.3f} GiB ({ratio:.3f}x)"
        )
        return "\n".join(lines)

    def diff(self, other: QuantPlan) -> list[str]:
        """Human-readable disagreements with another plan (trainer vs converter vs rollout); [] if equal."""
        out = [
            f"{key}: {mine!r} != {theirs!r}"
            for key, mine, theirs in (
                ("family", self.family.value, other.family.value),
                ("precision", self.precision.value, other.precision.value),
                ("settings", self.settings, other.settings),
            )
            if mine != theirs
        ]
        mine, theirs = self._lookup(), other._lookup()
        only_mine = [n for n in mine if n not in theirs]
        only_theirs = [n for n in theirs if n not in mine]
        out += _limited([f"{n}: only in {self.model_name}" for n in only_mine])
        out += _limited([f"{n}: only in {other.model_name}" for n in only_theirs])
        changed = []
        for name, p in mine.items():
            q = theirs.get(name)
            if q is None or p == q:
                continue
            fields = [
                f"{f} {getattr(p, f)!r} != {getattr(q, f)!r}"
                for f in _JSON_FIELDS[1:]
                if getattr(p, f) != getattr(q, f)
            ]
            changed.append(f"{name}: " + "; ".join(fields))
        return out + _limited(changed)

    # JSON --------------------------------------------------------------------------------------------

    def to_json(self) -> str:
        """Compact, deterministic JSON: one array per tensor, wire layouts listed once and referenced."""
        templates: dict[tuple, int] = {}
        rows = []
        for p in self.params:
            index = templates.setdefault(p.wire_template, len(templates))
            block = None if p.block is None else list(p.block)
            rows.append(
                [
                    p.name,
                    p.role.value,
                    list(p.shape),
                    p.dtype_name,
                    p.quantized,
                    p.format,
                    block,
                    p.bytes,
                    index,
                ]
            )
        return json.dumps(
            {
                "version": PLAN_VERSION,
                "family": self.family.value,
                "precision": self.precision.value,
                "model_name": self.model_name,
                "settings": self.settings,
                "fields": _JSON_FIELDS,
                "wire_templates": [[[sfx, list(shape), dt] for sfx, shape, dt in t] for t in templates],
                "params": rows,
            },
            separators=(",", ":"),
        )

    @classmethod
    def from_json(cls, text: str) -> QuantPlan:
        """Read `to_json` output; a different version or a malformed entry is a PlanError."""
        try:
            data = json.loads(text)
            if data["version"] != PLAN_VERSION or data["fields"] != _JSON_FIELDS:
                raise PlanError(
                    f"plan JSON version {data['version']} / fields differ from this skyq ({PLAN_VERSION})"
                )
            templates = [
                tuple((sfx, tuple(shape), _dtype(dt)) for sfx, shape, dt in t) for t in data["wire_templates"]
            ]
            roles = {r.value: r for r in Role}
            params = tuple(
                ParamPlan(name, roles[role], tuple(shape), _dtype(dtype), bool(quantized), fmt,
                          None if block is None else tuple(block), int(nbytes), templates[index])
                for name, role, shape, dtype, quantized, fmt, block, nbytes, index in data["params"]
            )  # fmt: skip
            return cls(ModelFamily(data["family"]), Precision(data["precision"]), data["model_name"],
                       data["settings"], params)  # fmt: skip
        except (KeyError, TypeError, ValueError, IndexError) as err:
            if isinstance(err, PlanError):
                raise
            raise PlanError(f"not a skyq quantization plan: {type(err).__name__}: {err}") from None


def _limited(lines: list[str]) -> list[str]:
    if len(lines) <= _DIFF_LIMIT:
        return lines
    return lines[:_DIFF_LIMIT] + [f"... and {len(lines) - _DIFF_LIMIT} more like these"]


def _dtype(text: str) -> str:
    if text not in dtype_names.ITEMSIZE:
        raise PlanError(f"unknown dtype {text!r} in plan JSON; known: {sorted(dtype_names.ITEMSIZE)}")
    return text


def build_plan(model_cfg: ModelConfig, precision_cfg: PrecisionConfig) -> QuantPlan:
    """The plan of `model_cfg` under `precision_cfg`, from the configs alone (no weights, no GPU).

    A quantized weight whose shape the format cannot take (K not a multiple of the MX block or of the
    INT4 group) is refused here, naming the tensor and the arithmetic, before anything starts.
    """
    layout, strategy = get_layout(model_cfg.family), get_strategy(precision_cfg)
    fmt, block = strategy.format_name, strategy.block()
    # Decisions depend on (role, shape, is-a-weight) only: compute each once (Kimi: 70k tensors,
    # a handful of distinct keys), naming the first tensor of a key in any error.
    decided: dict[tuple[Role, tuple[int, ...], bool], tuple[bool, int, tuple]] = {}
    params = []
    for spec in layout.hf_parameters(model_cfg):
        key = (spec.role, spec.shape, spec.name.endswith(".weight"))
        decision = decided.get(key)
        if decision is None:
            quantized = strategy.quantizes_param(spec.name, spec.shape, spec.role)
            wire = strategy.wire_specs(spec.name, spec.shape, spec.role)
            stem = spec.name.removesuffix("weight") if quantized else spec.name
            template = tuple((w.name[len(stem) :], w.shape, w.dtype_name) for w in wire)
            nbytes = sum(w.nbytes for w in wire)
            decision = decided[key] = (quantized, nbytes, template)
        quantized, nbytes, template = decision
        params.append(
            ParamPlan(spec.name, spec.role, spec.shape, spec.dtype_name, quantized, fmt if quantized else None,
                      block if quantized else None, nbytes, template)
        )  # fmt: skip
    return QuantPlan(
        model_cfg.family, precision_cfg.name, model_cfg.name, strategy.wire_settings(), tuple(params)
    )
