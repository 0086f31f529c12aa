"""`QuantizationStrategy`: everything one precision implies, and the registry keyed by `Precision`.

A strategy answers, for its precision: which roles it quantizes, the wire tensors of a parameter
(`wire_specs` from shapes alone, `serialize` from data — the plan and the sender agree by
construction because both go through `wire_specs`), how the engine reads them back (`deserialize`),
the trainer's fake-quant (`fake_quant`, bit-identical to `deserialize(serialize(w))`), the engine's
`quantization_config`, the Transformer Engine recipe and the environment both sides need.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, ClassVar, NamedTuple

from skyq.config.enums import Fp8Recipe, Precision, QuantScope
from skyq.config.schema import ModelConfig, PrecisionConfig
from skyq.quant import dtype_names
from skyq.quant.layouts import ModelQuantizationLayout, Role, hf_dtype_name
from skyq.quant.layouts import experts as expert_layout

if TYPE_CHECKING:
    import torch
    from torch import Tensor

    from skyq.quant.plan import QuantPlan

# torch, the quantizers (`skyq.quant.kernels.dispatch`, `fake_quant`) and `QuantizationError`
# (skyq.quant.errors imports torch) are imported by the methods that handle tensors: the scope and
# wire-spec methods serve the plan, which a dry run builds without torch.


class _LazyDispatch:
    """`skyq.quant.kernels.dispatch`, imported on first attribute access (it imports torch); a
    module attribute, so a test can stand in for it."""

    def __getattr__(self, name: str) -> object:
        from skyq.quant.kernels import dispatch as module

        return getattr(module, name)


dispatch = _LazyDispatch()

LINEAR_SCOPE: dict[QuantScope, frozenset[Role]] = {
    QuantScope.routed_experts: frozenset({Role.routed_expert}),
    QuantScope.all_linear: frozenset(
        {Role.routed_expert, Role.shared_expert, Role.attention, Role.dense_mlp}
    ),
}
"""Roles each scope covers. Router, norms, embeddings, lm_head, vision and MTP are in neither."""


class WireSpec(NamedTuple):
    """One tensor on the wire / in the checkpoint: its name, shape and dtype."""

    name: str
    shape: tuple[int, ...]
    dtype_name: str
    """The dtype by name (`torch.float8_e4m3fn`, see `dtype_names`): specs are made without torch."""

    @property
    def dtype(self) -> torch.dtype:
        """The torch dtype (imports torch)."""
        return dtype_names.torch_dtype(self.dtype_name)

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor."""
        return math.prod(self.shape) * dtype_names.ITEMSIZE[self.dtype_name]


class StrategyError(ValueError):
    """A strategy asked to do something its precision or config cannot (wrong plan, unresolved recipe)."""


class QuantizationStrategy(ABC):
    """One precision: scope, wire format, engine config, trainer recipe and environment."""

    precision: ClassVar[Precision]
    format_name: ClassVar[str | None]
    """Name of the wire format of quantized weights (`fp8_blockwise`, `mxfp8`, `int4`), None for bf16."""
    wire_suffixes: ClassVar[tuple[str, ...]] = ()
    """What a quantized `X.weight` becomes: `X` + each suffix."""

    def __init__(self, precision_cfg: PrecisionConfig) -> None:
        if precision_cfg.name is not self.precision:
            raise StrategyError(
                f"precision.name={precision_cfg.name.value} given to the {self.precision.value} strategy"
            )
        self.precision_cfg = precision_cfg
        self._stack_layouts: dict[tuple[object, ...], tuple] = {}
        """`serialize_stack_tensors`' treatment and member names per (names, shape, role)."""

    # scope -------------------------------------------------------------------------------------

    @property
    @abstractmethod
    def quantized_roles(self) -> frozenset[Role]:
        """The roles whose 2-D `.weight` tensors this precision quantizes."""

    def quantizes(self, role: Role) -> bool:
        """Whether parameters of `role` are quantized (their 2-D `.weight`; biases never are)."""
        return role in self.quantized_roles

    def quantizes_param(self, name: str, shape: tuple[int, ...], role: Role) -> bool:
        """Whether this exact tensor is quantized: a quantized role, a `.weight`, exactly 2-D."""
        return self.quantizes(role) and name.endswith(".weight") and len(shape) == 2

    def wire_settings(self) -> dict[str, object]:
        """The settings that change the wire bytes (block, grid, scale format), as plain JSON values."""
        return {}

    def block(self) -> tuple[int, ...] | None:
        """The quantization block (rows, cols) or group (1, G) of quantized weights; None for bf16."""
        return None

    # wire --------------------------------------------------------------------------------------

    def wire_specs(self, name: str, shape: tuple[int, ...], role: Role) -> list[WireSpec]:
        """The wire tensors of one parameter, from its shape alone; raises if the format cannot take it."""
        if not self.quantizes_param(name, shape, role):
            return [WireSpec(name, tuple(shape), hf_dtype_name(role))]
        return self._quantized_wire_specs(name[: -len("weight")], tuple(shape))

    def _quantized_wire_specs(self, stem: str, shape: tuple[int, ...]) -> list[WireSpec]:
        raise StrategyError(
            f"{self.precision.value} quantizes no tensor, yet {stem}weight reached its quantized path"
        )

    def serialize(self, name: str, tensor: Tensor, *, role: Role) -> dict[str, Tensor]:
        """The wire tensors of `tensor` (named as FORMATS.md says); unquantized ones pass through."""
        shape = tuple(tensor.shape)
        specs = self.wire_specs(name, shape, role)
        if not self.quantizes_param(name, shape, role):
            return {name: tensor.to(specs[0].dtype)}
        return self._checked(self._encode(name[: -len("weight")], tensor), specs)

    @staticmethod
    def _checked(wire: dict[str, Tensor], specs: Sequence[WireSpec]) -> dict[str, Tensor]:
        for spec in specs:  # the plan promised these; a format change that breaks it must not ship
            got = wire[spec.name]
            assert (tuple(got.shape), got.dtype) == (spec.shape, spec.dtype), (spec, got.shape, got.dtype)
        return wire

    def serialize_stack(self, names: Sequence[str], stack: Tensor, *, role: Role) -> list[dict[str, Tensor]]:
        """`serialize` of each `stack[i]` named `names[i]`, with one quantizer call for the stack.

        `stack` is [E, N, K]: independent matrices of one role and shape (e.g. one projection's
        routed experts). The wire tensors are views of the batched outputs, bit-identical to
        `serialize(names[i], stack[i], role=role)` (every format quantizes each matrix on its own)."""
        whole = self.serialize_stack_tensors(names, stack, role=role)
        if whole is None:
            return [self.serialize(name, stack[i], role=role) for i, name in enumerate(names)]
        keys = zip(*(member_names for member_names, _ in whole))
        values = zip(*(t.unbind(0) for _, t in whole))
        return [dict(zip(k, v)) for k, v in zip(keys, values)]

    def serialize_stack_tensors(
        self, names: Sequence[str], stack: Tensor, *, role: Role
    ) -> list[tuple[tuple[str, ...], Tensor]] | None:
        """The wire tensors of a stack [E, N, K] as whole tensors: one `(member names, tensor [E, ...])`
        per wire position, where `tensor[i]` is the wire tensor `serialize(names[i], stack[i])` names
        `member names[i]`, bit for bit. One quantizer call and one shape check per wire position: no
        per-member tensor work. None when the members are not all serialized alike (then use
        `serialize` per member)."""
        kind, stems, out_names, specs = self._stack_plan(names, stack, role)
        if kind == "members":
            return None
        if kind == "whole":
            return [(out_names[0], stack.to(specs[0].dtype))]
        return self._stack_columns(stems, out_names, specs, self._encode_stack(stems, stack))

    def serialize_many(
        self, entries: Sequence[tuple[str | tuple[str, ...], Tensor, Role]]
    ) -> list[dict[str, Tensor] | list[tuple[tuple[str, ...], Tensor]] | None]:
        """Per entry, `serialize(name, tensor)` for a name, `serialize_stack_tensors(names, stack)`
        for a tuple of names: the same wire tensors, bit for bit, with every quantized matrix and
        stack of the entries encoded by one `_encode_group` call (a format batches its quantizer
        launches there)."""
        out: list = [None] * len(entries)
        todo: list[tuple[int, object]] = []  # (entry, its wire specs or its stack plan), in group order
        inputs: list[Tensor] = []
        stems: list[Sequence[str]] = []
        for i, (name, t, role) in enumerate(entries):
            if isinstance(name, str):
                if not self.quantizes_param(name, tuple(t.shape), role):
                    out[i] = self.serialize(name, t, role=role)
                    continue
                todo.append((i, self.wire_specs(name, tuple(t.shape), role)))
                stems.append([name[: -len("weight")]])
            else:
                plan = self._stack_plan(name, t, role)
                if plan[0] != "quantized":
                    out[i] = self.serialize_stack_tensors(name, t, role=role)
                    continue
                todo.append((i, plan))
                stems.append(plan[1])
            inputs.append(t)
        for (i, meta), wire in zip(todo, self._encode_group(inputs, stems) if inputs else []):
            if isinstance(meta, list):  # one matrix: its wire specs
                named = wire if isinstance(wire, dict) else dict(zip((spec.name for spec in meta), wire))
                out[i] = self._checked(named, meta)
            else:
                _, member_stems, out_names, specs = meta
                out[i] = self._stack_columns(member_stems, out_names, specs, wire)
        return out

    def serialize_many_into(
        self,
        entries: Sequence[tuple[str | tuple[str, ...], Tensor, Role]],
        outs: Sequence[Sequence[tuple[int, int, tuple[Tensor, ...]]]],
    ) -> list[bool]:
        """`serialize_many`, written straight into the caller's tensors where this format can (a
        weight sync's bucket bytes): entry i goes into `outs[i]`, pieces (first, count, one tensor
        per wire position): a matrix one piece (0, 1, tensors of its wire shapes), a stack [E, N,
        K] members first .. first + count - 1 into tensors with a leading `count`. Returns per entry
        whether it was written (the same bits as `serialize_many`); the caller serializes the rest.
        Only quantized matrices and stacks are written, and only by a format whose quantizer takes
        outputs (`_encode_group_into`)."""
        done = [False] * len(entries)
        xs: list[Tensor] = []
        names: list[str] = []
        dests: list[tuple[Tensor, ...]] = []
        taken: list[int] = []
        for i, ((name, t, role), pieces) in enumerate(zip(entries, outs, strict=True)):
            if isinstance(name, str):
                if not self.quantizes_param(name, tuple(t.shape), role):
                    continue
                specs, stems, stacked = (
                    self.wire_specs(name, tuple(t.shape), role),
                    [name[: -len("weight")]],
                    False,
                )
            else:
                kind, stems, _, specs = self._stack_plan(name, t, role)
                if kind != "quantized":
                    continue
                stacked = True
            for first, count, views in pieces:
                for spec, view in zip(specs, views, strict=True):
                    want = (count, *spec.shape) if stacked else spec.shape
                    if (tuple(view.shape), view.dtype) != (tuple(want), spec.dtype):
                        raise StrategyError(
                            f"serialize_many_into: {spec.name} needs {spec.dtype}{list(want)}, "
                            f"given a place of {view.dtype}{list(view.shape)}"
                        )
                xs.append(t[first : first + count] if stacked else t)
                names.append(stems[first] + "weight")
                dests.append(views)
            taken.append(i)
        if xs and self._encode_group_into(xs, names, dests):
            for i in taken:
                done[i] = True
        return done

    grouped_quantizer: ClassVar[bool] = False
    """Whether the format has `_quantize_group`: all of a call's matrices and stacks in one launch
    on CUDA, able to write into given tensors."""

    def _quantize_group(
        self, inputs: Sequence[Tensor], names: Sequence[str], out: Sequence[tuple[Tensor, ...]] | None = None
    ) -> list[tuple[Tensor, ...]]:
        """The wire tensors of each input (`wire_specs` order) by one grouped quantizer call,
        written into `out` when given; formats with `grouped_quantizer` implement it."""
        raise StrategyError(f"{self.precision.value} has no grouped quantizer")

    def _encode_group_into(
        self, inputs: Sequence[Tensor], names: Sequence[str], outs: Sequence[tuple[Tensor, ...]]
    ) -> bool:
        """Encode each input (a matrix, or a run of a stack's members) into `outs` (its wire tensors
        in `wire_specs` order, contiguous) and return True: by the grouped quantizer, on CUDA. Else
        return False, writing nothing (no grouped quantizer; or not on CUDA, where the quantizer
        runs per tensor and whole stacks then copied beat one call per piece); the caller then
        serializes and copies. `names`: the name of each input's (first) weight, for errors."""
        if not self.grouped_quantizer or not all(dispatch.uses_kernel(x) for x in inputs):
            return False
        self._quantize_group(inputs, names, out=list(outs))
        return True

    def _encode_group(
        self, inputs: Sequence[Tensor], stems: Sequence[Sequence[str]]
    ) -> list[tuple[Tensor, ...]]:
        """The wire tensors (in `wire_specs` order) of each quantized input: a matrix [N, K] with
        its one stem, or a stack [E, N, K] with its members' stems. One grouped call for a format
        with `grouped_quantizer`, else one input at a time."""
        if self.grouped_quantizer:
            return self._quantize_group(inputs, [s[0] + "weight" for s in stems])
        return [
            tuple(self._encode_stack(s, t)) if t.ndim == 3 else tuple(self._encode(s[0], t).values())
            for t, s in zip(inputs, stems)
        ]

    def _stack_plan(
        self, names: Sequence[str], stack: Tensor, role: Role
    ) -> tuple[str, list[str], list[tuple[str, ...]], list[WireSpec]]:
        """`_stack_layout` of a stack, checked against its names and kept per (names, shape, role)."""
        if stack.ndim != 3 or len(names) != stack.shape[0]:
            raise StrategyError(
                f"serialize_stack: {len(names)} names for a stack of shape {tuple(stack.shape)}"
            )
        shape = tuple(stack.shape[1:])
        key = (tuple(names), shape, role)
        layout = self._stack_layouts.get(key)
        if layout is None:  # a trainer sends the same stacks every sync: names worked out once
            layout = self._stack_layouts[key] = self._stack_layout(key[0], shape, role)
        return layout

    @staticmethod
    def _stack_columns(
        stems: Sequence[str],
        out_names: Sequence[tuple[str, ...]],
        specs: Sequence[WireSpec],
        whole: Sequence[Tensor],
    ) -> list[tuple[tuple[str, ...], Tensor]]:
        # Every member has the specs of the first with its own stem (same shape, same role).
        assert len(whole) == len(specs), (stems[0], len(whole), specs)
        for spec, t in zip(specs, whole):
            assert (tuple(t.shape), t.dtype) == ((len(stems), *spec.shape), spec.dtype), (
                spec,
                t.shape,
                t.dtype,
            )
        return list(zip(out_names, whole))

    def _stack_layout(
        self, names: tuple[str, ...], shape: tuple[int, ...], role: Role
    ) -> tuple[str, list[str], list[tuple[str, ...]], list[WireSpec]]:
        """How `serialize_stack_tensors` treats a stack of `names` (member shape `shape`): "members"
        (one at a time), "whole" (passed through as is) or "quantized", with the stems, the member
        names of each wire position and the first member's wire specs."""
        specs = self.wire_specs(names[0], shape, role)
        # `quantizes_param` of every member: role and shape are shared, only the names differ.
        weights = sum(name.endswith(".weight") for name in names)
        if not self.quantizes_param(names[0], shape, role):
            if self.quantizes(role) and len(shape) == 2 and weights:
                return "members", [], [], specs
            return "whole", [], [names], specs
        if weights != len(names):
            return "members", [], [], specs
        stems = [name[: -len("weight")] for name in names]
        out_names = [tuple(stem + spec.name[len(stems[0]) :] for stem in stems) for spec in specs]
        return "quantized", stems, out_names, specs

    def _encode_stack(self, stems: Sequence[str], stack: Tensor) -> tuple[Tensor, ...]:
        """The wire tensors of every matrix of `stack`, stacked [E, ...] per wire position (in
        `wire_specs` order); this default encodes one matrix at a time, formats override it with
        one batched quantizer call."""
        import torch

        wires = [list(self._encode(stem, stack[i]).values()) for i, stem in enumerate(stems)]
        return tuple(torch.stack(column) for column in zip(*wires))

    def _encode(self, stem: str, tensor: Tensor) -> dict[str, Tensor]:
        raise StrategyError(
            f"{self.precision.value} quantizes no tensor, yet {stem}weight reached its quantized path"
        )

    def deserialize(
        self, name: str, wire: Mapping[str, Tensor], *, role: Role, dtype: torch.dtype | None = None
    ) -> Tensor:
        """The tensor an engine computes with: dequantized (in `dtype`, None: bf16) or the unquantized
        tensor as sent.

        `role` says whether `name` is quantized under this precision; a quantized weight must arrive
        as its whole unit (weight and scales, nothing else), so an e4m3 weight without its scale is an
        error naming what is missing, never a tensor read as if it were bf16.
        """
        lone = wire.get(name) if set(wire) == {name} else None
        if lone is not None and not self.quantizes_param(name, tuple(lone.shape), role):
            return lone
        stem = name.removesuffix("weight")
        expected = {stem + suffix for suffix in self.wire_suffixes}
        if not self.quantizes(role) or not name.endswith(".weight") or set(wire) != expected:
            from skyq.quant.errors import QuantizationError

            want = sorted(expected) if self.quantizes(role) and name.endswith(".weight") else [name]
            raise QuantizationError(
                f"{name} ({role.value}): {self.precision.value} wire tensors must be exactly {want}, "
                f"got {sorted(wire)}"
            )
        if dtype is None:
            dtype = dtype_names.torch_dtype(dtype_names.BF16)
        return self._decode(stem, wire, dtype)

    def _decode(self, stem: str, wire: Mapping[str, Tensor], dtype: torch.dtype) -> Tensor:
        raise StrategyError(
            f"{self.precision.value} quantizes no tensor, yet {stem}weight reached its quantized path"
        )

    # trainer -----------------------------------------------------------------------------------

    @abstractmethod
    def fake_quant(self, tensor: Tensor, *, name: str = "weight") -> Tensor:
        """dequant(quant(tensor)) in the tensor's dtype with a straight-through gradient.

        Leading dims are independent matrices ([..., N, K]); pass one projection's expert stack, never
        a fused gate_up tensor (use `fake_quant_param`, which splits it).
        """

    def fake_quant_param(
        self, trainer_name: str, tensor: Tensor, *, layout: ModelQuantizationLayout, model_cfg: ModelConfig
    ) -> Tensor:
        """Fake-quant one trainer parameter if this precision quantizes it, else return it unchanged.

        Fused expert tensors are fake-quantized per expert and per projection (gate and up apart),
        so no block or group straddles gate/up rows or two experts — exactly what `serialize` of the
        split HF tensors produces.
        """
        role = layout.role(trainer_name, model_cfg)
        if expert_layout.parse_fused_name(trainer_name) is None:
            if not self.quantizes_param(trainer_name, tuple(tensor.shape), role):
                return tensor
            return self.fake_quant(tensor, name=trainer_name)
        if not self.quantizes(role):
            return tensor
        stacks = expert_layout.projection_stacks(trainer_name, tensor, model_cfg)
        parts = [self.fake_quant(stack, name=f"{trainer_name}[{projection}]") for projection, stack in stacks]
        if len(parts) == 1:
            return parts[0]
        import torch

        return torch.cat(parts, dim=1)

    def te_recipe_kwargs(self) -> dict[str, object] | None:
        """Transformer Engine recipe for a Megatron trainer, as plain data (None: no TE FP8 recipe).

        `recipe` names the TE class in `transformer_engine.common.recipe`; the other keys are its
        constructor arguments, except those documented per strategy.
        """
        return None

    def env_vars(self, resolved_recipe: Fp8Recipe) -> dict[str, dict[str, str]]:
        """Environment for trainer and engine processes, given the FP8 recipe the WORKERS resolved.

        `auto` is refused: env vars depend on the device, and the driver must never guess it.
        """
        if resolved_recipe is Fp8Recipe.auto:
            raise StrategyError(
                "env_vars needs the fp8 recipe the workers resolved (blockwise or mxfp8), got `auto`: "
                "resolve precision.fp8_recipe on each worker first and pass the agreed value"
            )
        return {"trainer": {}, "engine": {}}

    # checkpoint / engine -----------------------------------------------------------------------

    @abstractmethod
    def quantization_config(self, plan: QuantPlan) -> dict[str, object] | None:
        """The `quantization_config` block of the engine's config.json (None: plain bf16 checkpoint)."""

    def _check_plan(self, plan: QuantPlan) -> None:
        if plan.precision is not self.precision:
            raise StrategyError(
                f"quantization_config: the plan was built for precision {plan.precision.value}, "
                f"this strategy is {self.precision.value}; rebuild the plan with the same precision config"
            )


_REGISTRY: dict[Precision, type[QuantizationStrategy]] = {}


def register_strategy(cls: type[QuantizationStrategy]) -> type[QuantizationStrategy]:
    """Class decorator: make `cls` the strategy of `cls.precision` (one per precision)."""
    if cls.precision in _REGISTRY:
        raise StrategyError(
            f"two strategies for precision {cls.precision.value}: {_REGISTRY[cls.precision]}, {cls}"
        )
    _REGISTRY[cls.precision] = cls
    return cls


def strategy_class(precision: Precision) -> type[QuantizationStrategy]:
    """The registered strategy class of a precision."""
    try:
        return _REGISTRY[precision]
    except KeyError:
        raise StrategyError(
            f"precision.name={precision!r} has no registered strategy; known: {sorted(p.value for p in _REGISTRY)}"
        ) from None
