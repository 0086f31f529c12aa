"""What every model layout provides: parameter roles, HF names and shapes, trainer <-> HF names.

A `ModelQuantizationLayout` knows one architecture family. From a `ModelConfig` alone (no weights) it
lists every tensor of the HF checkpoint with its shape, dtype and `Role`; the quantization plan, the
converters and the weight sync all start from that list, so they cannot disagree about names.

The trainer holds a transformers-5 module, whose routed experts are fused 3-D tensors
(`mlp.experts.gate_up_proj` (E, 2I, H), gate rows first; `mlp.experts.down_proj` (E, H, I)); the HF
checkpoint and the engines use one 2-D tensor per expert and projection
(`mlp.experts.{e}.{gate,up,down}_proj.weight`). `split_experts` / `fuse_experts` convert between them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, ClassVar, NamedTuple

from skyq.config.enums import ModelFamily
from skyq.config.schema import ModelConfig
from skyq.quant import dtype_names
from skyq.quant.layouts import experts

if TYPE_CHECKING:
    import torch
    from torch import Tensor


class Role(str, Enum):
    """What a parameter is for; strategies decide per role whether to quantize it."""

    routed_expert = "routed_expert"
    shared_expert = "shared_expert"
    attention = "attention"
    dense_mlp = "dense_mlp"
    router = "router"
    router_bias = "router_bias"
    norm = "norm"
    embedding = "embedding"
    lm_head = "lm_head"
    vision = "vision"
    mtp = "mtp"


LINEAR_ROLES: frozenset[Role] = frozenset(
    {Role.routed_expert, Role.shared_expert, Role.attention, Role.dense_mlp, Role.router, Role.lm_head}
    | {Role.vision, Role.mtp}
)
"""Roles whose 2-D `.weight` belongs to a linear layer (vision and MTP hold linears among other things)."""


class LayoutError(ValueError):
    """A parameter name the layout does not know, or a model config the layout cannot describe."""


def hf_dtype_name(role: Role) -> str:
    """The checkpoint dtype (by name, `dtype_names`) of an unquantized parameter: fp32 for the
    router bias, else bf16.

    DeepSeek-V3 / Kimi keep `e_score_correction_bias` in fp32 (it is added to sigmoid scores and a
    bf16 copy changes expert selection); every other unquantized tensor is bf16.
    """
    return dtype_names.FP32 if role is Role.router_bias else dtype_names.BF16


class ParamSpec(NamedTuple):
    """One tensor of the HF checkpoint, derived from the model config alone.

    A NamedTuple rather than a frozen dataclass: Kimi-K2.6 has ~70k of them and a frozen dataclass
    is several times slower to construct.
    """

    name: str
    shape: tuple[int, ...]
    role: Role
    dtype_name: str
    """The checkpoint dtype by name (`torch.bfloat16`): specs are made without importing torch."""

    @property
    def dtype(self) -> torch.dtype:
        """The checkpoint dtype (imports torch)."""
        return dtype_names.torch_dtype(self.dtype_name)


@dataclass(frozen=True, slots=True)
class ExpertSlot:
    """Where one HF per-expert tensor lives inside a trainer fused expert tensor."""

    trainer_name: str
    """The fused trainer tensor, e.g. `model.layers.3.mlp.experts.gate_up_proj`."""
    expert: int
    projection: str
    """`gate_proj`, `up_proj` or `down_proj`."""


def require_positive(model_cfg: ModelConfig, *keys: str) -> None:
    """Refuse a model config whose named dims are not positive integers (a layout needs them)."""
    for key in keys:
        value = getattr(model_cfg, key)
        if not isinstance(value, int) or value <= 0:
            raise LayoutError(
                f"model.{key}={value!r}: the {model_cfg.family.value} layout needs a positive integer here"
            )


# The HF causal-LM names outside the decoder layers, the same in every family.
_TOP_ROLES: dict[str, Role] = {
    "model.embed_tokens.weight": Role.embedding,
    "model.norm.weight": Role.norm,
    "lm_head.weight": Role.lm_head,
}


class ModelQuantizationLayout(ABC):
    """HF names, shapes and roles of one architecture family, and its trainer <-> HF name maps."""

    family: ClassVar[ModelFamily]

    @abstractmethod
    def hf_parameters(self, model_cfg: ModelConfig) -> list[ParamSpec]:
        """Every tensor of the HF checkpoint (name, shape, role, dtype), in a deterministic order."""

    @abstractmethod
    def _text_role(self, body: str, model_cfg: ModelConfig) -> Role:
        """Role of a text-model name with the checkpoint's text prefix removed; LayoutError if unknown."""

    def _top_role(self, body: str, model_cfg: ModelConfig) -> Role | None:
        """Role of a text-model name outside the decoder layers (embeddings, final norm, lm_head),
        None if not one; LayoutError for an lm_head of a model with tied embeddings."""
        top = _TOP_ROLES.get(body)
        if top is Role.lm_head and model_cfg.tie_word_embeddings:
            raise LayoutError(f"{body}: model.tie_word_embeddings=true, so the checkpoint has no lm_head")
        return top

    def _other_role(self, name: str, model_cfg: ModelConfig) -> Role | None:
        """Role of a name outside the text model (vision tower, projector), None if not one."""
        return None

    def role(self, name: str, model_cfg: ModelConfig) -> Role:
        """The role of an HF or trainer parameter name; LayoutError naming it if the layout lacks it."""
        other = self._other_role(name, model_cfg)
        if other is not None:
            return other
        return self._text_role(name.removeprefix(model_cfg.text_prefix), model_cfg)

    def module_name(self, param_name: str) -> str:
        """The module owning a parameter: `a.b.weight` -> `a.b`; fused `..experts.down_proj` -> `..experts`."""
        module, sep, _ = param_name.rpartition(".")
        if not sep:
            raise LayoutError(f"{param_name!r} has no module part (expected `<module>.<param>`)")
        return module

    # trainer <-> HF names -------------------------------------------------------------------------

    def is_text_name(self, hf_name: str, model_cfg: ModelConfig) -> bool:
        """Whether an HF name belongs to the text model (the part a causal-LM trainer holds)."""
        return self._other_role(hf_name, model_cfg) is None

    def expert_slot(self, hf_name: str, model_cfg: ModelConfig) -> ExpertSlot | None:
        """The fused trainer tensor an HF per-expert weight belongs to, or None for any other name."""
        parsed = experts.parse_expert_name(hf_name.removeprefix(model_cfg.text_prefix))
        if parsed is None:
            return None
        module, expert, projection = parsed
        if not 0 <= expert < model_cfg.num_experts:
            raise LayoutError(
                f"{hf_name}: expert {expert} is outside model.num_experts={model_cfg.num_experts}"
            )
        return ExpertSlot(experts.fused_name(module, projection), expert, projection)

    def hf_to_trainer_name(self, hf_name: str, model_cfg: ModelConfig) -> str:
        """The trainer parameter holding an HF tensor (the fused tensor for a per-expert weight)."""
        slot = self.expert_slot(hf_name, model_cfg)
        if slot is not None:
            return slot.trainer_name
        if not self.is_text_name(hf_name, model_cfg):
            return hf_name
        if model_cfg.text_prefix and not hf_name.startswith(model_cfg.text_prefix):
            raise LayoutError(
                f"{hf_name}: text weights of this checkpoint start with {model_cfg.text_prefix!r}"
            )
        return hf_name.removeprefix(model_cfg.text_prefix)

    def trainer_to_hf_names(self, trainer_name: str, model_cfg: ModelConfig) -> list[str]:
        """The HF names a trainer parameter becomes: E per-expert names for a fused tensor, else one."""
        fused = experts.parse_fused_name(trainer_name)
        if fused is None:
            if not self.is_text_name(trainer_name, model_cfg):
                return [trainer_name]
            return [model_cfg.text_prefix + trainer_name]
        module, fused_leaf = fused
        prefix = model_cfg.text_prefix + module
        return [
            f"{prefix}.{e}.{projection}.weight"
            for projection in experts.PROJECTIONS_OF[fused_leaf]
            for e in range(model_cfg.num_experts)
        ]

    def split_experts(
        self, trainer_tensors: Mapping[str, Tensor], model_cfg: ModelConfig
    ) -> dict[str, Tensor]:
        """Trainer tensors -> HF tensors: fused experts become 2-D per-expert views, others get the prefix."""
        out: dict[str, Tensor] = {}
        for name, tensor in trainer_tensors.items():
            fused = experts.parse_fused_name(name)
            if fused is None:
                (hf_name,) = self.trainer_to_hf_names(name, model_cfg)
                out[hf_name] = tensor
                continue
            module, _ = fused
            for projection, stack in experts.projection_stacks(name, tensor, model_cfg):
                for e in range(stack.shape[0]):
                    out[f"{model_cfg.text_prefix}{module}.{e}.{projection}.weight"] = stack[e]
        return out

    def fuse_experts(self, hf_tensors: Mapping[str, Tensor], model_cfg: ModelConfig) -> dict[str, Tensor]:
        """HF tensors -> trainer tensors: per-expert weights are stacked into the fused 3-D tensors.

        Every fused tensor needs all `num_experts` experts of each of its projections; a missing one
        is an error naming it (a partial expert stack would silently train on garbage).
        """
        out: dict[str, Tensor] = {}
        groups: dict[str, dict[tuple[str, int], Tensor]] = {}
        for name, tensor in hf_tensors.items():
            slot = self.expert_slot(name, model_cfg)
            if slot is None:
                out[self.hf_to_trainer_name(name, model_cfg)] = tensor
            else:
                groups.setdefault(slot.trainer_name, {})[(slot.projection, slot.expert)] = tensor
        for trainer_name, members in groups.items():
            out[trainer_name] = experts.stack_projections(trainer_name, members, model_cfg)
        return out
