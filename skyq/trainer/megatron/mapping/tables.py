"""The HF <-> Megatron name table of a model config: one `Entry` per full (global) Megatron tensor.

A Megatron-core GPTModel names its weights after its modules (`decoder.layers.{l}.self_attention.
linear_qkv.weight`), and the two layer specs name some of them differently: the local spec (CPU)
keeps separate norms and one `ColumnParallelLinear` per expert
(`mlp.experts.local_experts.{e}.linear_fc1.weight`); the Transformer Engine spec fuses a norm into the
linear after it (`linear_qkv.layer_norm_weight`, `linear_fc1.layer_norm_weight`, MLA's
`linear_q_up_proj.layer_norm_weight`) and keeps a layer's experts in one `TEGroupedLinear`
(`mlp.experts.linear_fc1.weight{e}`). Each family module (`qwen3_moe`, `deepseek_v3`) gives, per
decoder layer, a dict from the layer-relative Megatron name to a `Rule`: how that tensor is made
from HF tensors (copied, the QKV of one query group interleaved, or gate and up stacked).

Names here are GLOBAL: an expert index is the model's expert number, not the index within the
experts of one expert-parallel rank (`sharding.global_name` / `local_name` convert).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from enum import Enum

from skyq.config.enums import ModelFamily
from skyq.config.schema import ModelConfig
from skyq.quant.layouts import ParamSpec, get_layout

SPECS = ("local", "te")
LAYER = "decoder.layers."
HF_LAYER = "model.layers."
EXPERT = "{e}"
"""Where a routed expert's index goes in a Megatron or HF name template."""


class MappingError(ValueError):
    """A name, shape or model config the HF <-> Megatron tables cannot place."""


class Kind(str, Enum):
    """How one Megatron tensor is made from its HF tensors."""

    copy = "copy"
    """One HF tensor, unchanged."""
    qkv = "qkv"
    """q_proj, k_proj, v_proj interleaved per query group: [q_g (heads/groups rows); k_g; v_g] per group."""
    gate_up = "gate_up"
    """gate_proj rows then up_proj rows (Megatron's gated `linear_fc1`)."""


@dataclass(frozen=True, slots=True)
class Rule:
    """A layer-relative Megatron name template's source: its kind and the HF names (layer-relative)."""

    kind: Kind
    hf: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Entry:
    """One full Megatron tensor and the HF tensors it is made from (full names, prefix included)."""

    megatron: str
    kind: Kind
    hf: tuple[str, ...]
    layer: int | None
    """The decoder layer, None outside the decoder layers (embedding, final norm, output layer)."""
    expert: int | None
    """The global routed-expert index, None for any other tensor."""


def check_spec(spec: str) -> None:
    if spec not in SPECS:
        raise MappingError(f"spec={spec!r}: the Megatron layer spec is one of {list(SPECS)}")


def copy(hf: str) -> Rule:
    return Rule(Kind.copy, (hf,))


def gate_up(hf_module: str) -> Rule:
    return Rule(Kind.gate_up, (f"{hf_module}.gate_proj.weight", f"{hf_module}.up_proj.weight"))


def expert_rules(spec: str | None) -> dict[str, Rule]:
    """The routed experts of an MoE layer; `spec=None` gives both specs' names (for parsing)."""
    hf = f"mlp.experts.{EXPERT}"
    local = {
        f"mlp.experts.local_experts.{EXPERT}.linear_fc1.weight": gate_up(hf),
        f"mlp.experts.local_experts.{EXPERT}.linear_fc2.weight": copy(f"{hf}.down_proj.weight"),
    }
    grouped = {
        f"mlp.experts.linear_fc1.weight{EXPERT}": gate_up(hf),
        f"mlp.experts.linear_fc2.weight{EXPERT}": copy(f"{hf}.down_proj.weight"),
    }
    if spec == "local":
        return local
    if spec == "te":
        return grouped
    return {**local, **grouped}


def _family(model_cfg: ModelConfig):
    from skyq.trainer.megatron.mapping import deepseek_v3, qwen3_moe

    family = ModelFamily(model_cfg.family)
    if family is ModelFamily.qwen3_moe:
        return qwen3_moe
    if family is ModelFamily.deepseek_v3:
        return deepseek_v3
    raise MappingError(f"model.family={family.value}: no Megatron mapping table")


def check_model(model_cfg: ModelConfig) -> None:
    """Refuse what the Megatron tables do not cover yet (MTP layers, a vision tower is skipped)."""
    if model_cfg.num_nextn_predict_layers:
        raise MappingError(
            f"model.num_nextn_predict_layers={model_cfg.num_nextn_predict_layers}: the Megatron "
            "mapping has no table for multi-token-prediction layers yet; set it to 0 and load a "
            "checkpoint without MTP layers"
        )


def layer_rules(model_cfg: ModelConfig, layer: int, spec: str | None) -> dict[str, Rule]:
    """Layer-relative Megatron name template -> Rule for decoder layer `layer` (`spec=None`: both specs)."""
    return _family(model_cfg).layer_rules(model_cfg, layer, spec)


def top_rules(model_cfg: ModelConfig) -> dict[str, Rule]:
    """The tensors outside the decoder layers (HF names without the text prefix)."""
    rules = {
        "embedding.word_embeddings.weight": copy("model.embed_tokens.weight"),
        "decoder.final_layernorm.weight": copy("model.norm.weight"),
    }
    if not model_cfg.tie_word_embeddings:
        rules["output_layer.weight"] = copy("lm_head.weight")
    return rules


def _entries(model_cfg: ModelConfig, template: str, rule: Rule, layer: int | None) -> list[Entry]:
    p = model_cfg.text_prefix
    hf_base = "" if layer is None else f"{HF_LAYER}{layer}."
    base = "" if layer is None else f"{LAYER}{layer}."
    if EXPERT not in template:
        return [Entry(base + template, rule.kind, tuple(p + hf_base + h for h in rule.hf), layer, None)]
    return [
        Entry(
            base + template.replace(EXPERT, str(e)),
            rule.kind,
            tuple(p + hf_base + h.replace(EXPERT, str(e)) for h in rule.hf),
            layer,
            e,
        )
        for e in range(model_cfg.num_experts)
    ]


def table(model_cfg: ModelConfig, spec: str) -> list[Entry]:
    """Every full Megatron tensor of the model (global expert indices) in export order: the
    embedding, then decoder layer by layer (each layer's routed experts last, expert-major), then
    the final norm and the output layer."""
    check_spec(spec)
    check_model(model_cfg)
    top = top_rules(model_cfg)
    out = _entries(
        model_cfg, "embedding.word_embeddings.weight", top["embedding.word_embeddings.weight"], None
    )
    for layer in range(model_cfg.num_layers):
        rules = layer_rules(model_cfg, layer, spec)
        plain = {t: r for t, r in rules.items() if EXPERT not in t}
        experts = {t: r for t, r in rules.items() if EXPERT in t}
        for template, rule in plain.items():
            out += _entries(model_cfg, template, rule, layer)
        per_template = [_entries(model_cfg, t, r, layer) for t, r in experts.items()]
        out += [entry for group in zip(*per_template) for entry in group]
    for name in ("decoder.final_layernorm.weight", "output_layer.weight"):
        if name in top:
            out += _entries(model_cfg, name, top[name], None)
    return out


def megatron_names(model_cfg: ModelConfig, spec: str) -> list[str]:
    """The full model's Megatron tensor names (parameters plus the router's `expert_bias` buffer)."""
    return [entry.megatron for entry in table(model_cfg, spec)]


def _config_key(model_cfg: ModelConfig) -> tuple:
    return tuple(getattr(model_cfg, f.name) for f in dataclasses.fields(model_cfg))


@functools.lru_cache(maxsize=8)
def _hf_specs_by_key(key: tuple) -> dict[str, ParamSpec]:
    names = [f.name for f in dataclasses.fields(ModelConfig)]
    model_cfg = ModelConfig(**dict(zip(names, key)))
    layout = get_layout(model_cfg.family)
    return {s.name: s for s in layout.hf_parameters(model_cfg) if layout.is_text_name(s.name, model_cfg)}


def hf_text_specs(model_cfg: ModelConfig) -> dict[str, ParamSpec]:
    """The layout's text-model HF tensors (name -> spec); cached per model config."""
    return _hf_specs_by_key(_config_key(model_cfg))
