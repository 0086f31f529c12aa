"""A megatron-core `GPTModel` for a skyq model config: the layer spec per device, precision and family.

`build_model` is called inside a Megatron worker after `torch.distributed` and megatron's
`parallel_state` are initialised. GPU: Transformer Engine's spec (`get_gpt_decoder_block_spec(...,
use_transformer_engine=True)`, grouped expert GEMMs, FP8 through TE recipes from the config). CPU:
the local spec (megatron-core modules only), fp32 parameters, with three skyq modules in it:

- `SkyqRMSNorm`: the HF models' RMSNorm, its weight marked `sequence_parallel` like Megatron's
  fused norms do (0.16.1's `WrappedTorchNorm`, the local spec's norm without Apex, refuses
  sequence parallelism outright), so `finalize_model_grads` sums its partial gradients across TP.
- `MLACoreAttention`: 0.16.1's local `DotProductAttention` does not take MLA's `k_channels` /
  `v_channels`, so the local MLA spec cannot be built; this subclass takes them (its output is
  heads x v_head_dim wide).
- `LocalMLASelfAttention`: MLA with the q / kv down-projections replicated on every TP rank, as TE's
  spec has them (`TELinear(parallel_mode="duplicated")`). The local spec's column-parallel
  down-projection computes the gradient of the rotary key rows (`k_pos_emb`, shared by all heads)
  from this rank's heads only and never reduces it across TP, so those rows' gradient, and every
  gradient upstream of it, is wrong. With the replicated projection the rotary key is gathered
  along the sequence (sequence parallelism, which MLA with tp > 1 requires, see config.py) and its
  gradient reduce-scattered; tests/megatron/test_model.py checks TP2 against TP1. Parameter names
  are unchanged and the shapes are the full ones, the same as the TE spec's.

No multi-token-prediction layers are built (`model.num_nextn_predict_layers` is a checkpoint fact;
RL trains the next-token head only).

precision=int4_qat swaps the linears of `precision.qat_scope` for fake-INT4 subclasses (fake_int4.py).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from skyq.config.enums import Precision, QuantScope
from skyq.config.schema import ModelConfig, ParallelConfig, PrecisionConfig, TrainerConfig
from skyq.trainer.megatron import fake_int4
from skyq.trainer.megatron.config import MegatronConfigError, device_kind, require_deepep, transformer_config


def build_model(
    model_cfg: ModelConfig,
    precision_cfg: PrecisionConfig,
    trainer_cfg: TrainerConfig,
    parallel_cfg: ParallelConfig,
    *,
    device: str,
    seed: int,
    gradient_accumulation_fusion: bool | None = None,
):
    """This rank's `GPTModel` (its pipeline stage, its TP / EP shards), initialised from `seed`.

    Initialisation: `model_parallel_cuda_manual_seed(seed)` (Megatron's tracked RNG states) and, on
    the CPU, `torch.manual_seed(seed)`: `use_cpu_initialization` draws each full weight from the CPU
    generator and keeps this rank's slice. The vocabulary is `model_cfg.vocab_size` exactly (Megatron
    core never pads it; it must divide by tp). Embeddings are tied iff `model_cfg.tie_word_embeddings`.
    Under pipeline parallelism the stage is megatron's `parallel_state` position: the embedding on the
    first stage, the final norm and output layer on the last, its decoder layers from the config's
    first / last stage counts (`topology.parallel.first_stage_layers` / `last_stage_layers`); with tied
    embeddings megatron gives the last stage a copy of the embedding as its output layer.
    `gradient_accumulation_fusion`: see `config.transformer_config` (None: where the GPU can).
    With bf16 compute (`config.bf16`) the caller wraps the model in megatron's `Float16Module`.
    """
    device = device_kind(device)
    if device == "cuda":
        require_deepep(trainer_cfg)
    if device == "cpu":
        from skyq.trainer.megatron import cpu_compat

        cpu_compat.apply()
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.gpt import GPTModel

    config = transformer_config(
        model_cfg,
        precision_cfg,
        trainer_cfg,
        parallel_cfg,
        device=device,
        gradient_accumulation_fusion=gradient_accumulation_fusion,
    )
    if model_cfg.vocab_size % parallel_cfg.tp:
        raise MegatronConfigError(
            f"model.vocab_size={model_cfg.vocab_size} is not a multiple of topology.parallel.tp="
            f"{parallel_cfg.tp}: Megatron splits the embedding and lm_head by rows across TP and skyq "
            "does not pad the vocabulary (the engine's is exact). Fix: a tp dividing the vocabulary"
        )
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    spec = block_spec(config, precision_cfg, device=device)
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=model_cfg.vocab_size,
        max_sequence_length=model_cfg.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=model_cfg.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=model_cfg.rope_theta,
    )
    mark_experts_expert_data_parallel(model, parallel_cfg)
    return model


def mark_experts_expert_data_parallel(model: torch.nn.Module, parallel_cfg: ParallelConfig) -> int:
    """Mark the routed experts' parameters `allreduce=False` at ep = 1 with etp != tp, so megatron's
    DDP reduces their gradients over the expert-data-parallel group and the optimizer treats them as
    expert parameters; the number of parameters marked (0 for every other layout).

    `allreduce=False` is megatron's mark of an expert parameter: DDP puts it in its expert buffers,
    reduced over the expert-data-parallel group (the ranks holding the same expert shard), and the
    optimizer in its expert part, sharded over that group. megatron-core 0.16.1 sets it from
    `expert_model_parallel_size > 1` alone (`ColumnParallelLinear` / `RowParallelLinear`,
    `TELinear`, `TEGroupedLinear`, `GroupedMLP`: `allreduce = not (is_expert and expert_parallel)`).
    At ep = 1 with etp < tp (e.g. TP2 ETP1) the experts are replicated across the TP ranks and each
    rank, under sequence parallelism, routes its own part of the sequence to them, so each holds a
    partial expert gradient; marked dense, those gradients are reduced over the data-parallel group
    only, which excludes the TP ranks: every TP rank stepped its replica with its own partial
    gradient (the replicas drift apart) and the grad norm summed the partials' squares (measured at
    TP2 ETP1 SP on the tiny Qwen3-MoE: log-probs after one step off by 5e-3, grad norm +0.02%).
    NVIDIA/Megatron-LM#5916 changes megatron's own predicate to `is_expert and (ep > 1 or etp != tp)`,
    which this applies; idempotent where a newer megatron-core marks them already."""
    if parallel_cfg.ep > 1 or parallel_cfg.etp == parallel_cfg.tp:
        return 0  # megatron marks them itself (ep > 1), or the two groups are the same ranks
    from megatron.core.transformer.moe.moe_layer import MoELayer

    marked = 0
    for module in model.modules():
        if isinstance(module, MoELayer):  # its routed experts; not the router or shared experts
            for param in module.experts.parameters():
                param.allreduce = False
                marked += 1
    return marked


def block_spec(config, precision_cfg: PrecisionConfig, *, device: str):
    """This pipeline stage's `TransformerBlockSubmodules`: TE spec on "cuda", local spec on "cpu",
    with the fake-INT4 linears of precision=int4_qat swapped in."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    te = device_kind(device) == "cuda"
    spec = copy.deepcopy(
        get_gpt_decoder_block_spec(config, use_transformer_engine=te, normalization="RMSNorm")
    )
    int4 = Precision(precision_cfg.name) is Precision.int4_qat
    if te:
        if int4:
            _swap_te_experts(spec, precision_cfg)
        return spec
    _localize(spec, config, precision_cfg if int4 else None)
    return spec


# --- local spec (CPU) --------------------------------------------------------------------------


class SkyqRMSNorm(torch.nn.RMSNorm):
    """RMSNorm with Megatron's norm constructor, its weight marked `sequence_parallel` (partial
    gradients under sequence parallelism, summed across TP by `finalize_model_grads`).

    The forward is the HF models' (Qwen3-MoE, DeepSeek-V3): normalise in fp32, cast back to the
    input dtype, then scale by the weight, so a bf16 trainer rounds where the checkpoint's model does.
    """

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **kwargs: Any) -> None:
        if config.normalization != "RMSNorm":
            raise MegatronConfigError(f"SkyqRMSNorm: config.normalization={config.normalization!r}")
        super().__init__(hidden_size, eps=eps)
        self.weight.sequence_parallel = config.sequence_parallel

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


def _mla_core_attention():
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.utils import divide

    class MLACoreAttention(DotProductAttention):
        """0.16.1's local `DotProductAttention` taking MLA's `k_channels` / `v_channels`: the query /
        key head width only sets the default softmax scale (MLA passes its own), the value head
        width sets the output's (heads x v_channels)."""

        def __init__(
            self, *args, k_channels: int | None = None, v_channels: int | None = None, **kwargs: Any
        ) -> None:
            # `Attention.__init__` builds a core attention without them first; MLA then rebuilds it
            super().__init__(*args, **kwargs)
            if v_channels is not None:
                tp = self.pg_collection.tp.size()
                self.hidden_size_per_partition = divide(v_channels * self.config.num_attention_heads, tp)

    return MLACoreAttention


class ReplicatedLinear(torch.nn.Module):
    """A bias-free linear held whole on every TP rank (Megatron's `(output, bias)` call convention).

    Under sequence parallelism it sees this rank's tokens only, so its weight is marked
    `sequence_parallel` and `finalize_model_grads` sums the gradient across TP. Initialised like
    Megatron's replicated weights: `init_method` on the full weight from the same generator state on
    every rank.
    """

    def __init__(self, input_size: int, output_size: int, *, config, init_method, fake_quant=None) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(
            torch.empty(
                output_size,
                input_size,
                dtype=config.params_dtype,
                device="cpu" if config.use_cpu_initialization else torch.cuda.current_device(),
            )
        )
        if config.perform_initialization:
            with torch.no_grad():
                init_method(self.weight)
        # Megatron's attributes of a parameter that is not split across TP (the optimizer counts it
        # once in the grad norm; loaders and exporters copy it whole)
        self.weight.tensor_model_parallel = False
        self.weight.partition_dim = -1
        self.weight.partition_stride = 1
        self.weight.sequence_parallel = config.sequence_parallel
        self.fake_quant = fake_quant

    def forward(self, x: Tensor) -> tuple[Tensor, None]:
        weight = self.weight if self.fake_quant is None else self.fake_quant(self.weight, "ReplicatedLinear")
        return F.linear(x, weight.to(x.dtype)), None


def _local_mla_attention():
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    class LocalMLASelfAttention(MLASelfAttention):
        """MLA whose q / kv down-projections are `ReplicatedLinear`s (see the module docstring)."""

        def __init__(self, *args, precision_cfg: PrecisionConfig | None = None, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            fq = fake_int4.Int4FakeQuant(precision_cfg) if precision_cfg is not None else None
            c = self.config
            if c.q_lora_rank is not None:
                self.linear_q_down_proj = ReplicatedLinear(
                    c.hidden_size, c.q_lora_rank, config=c, init_method=c.init_method, fake_quant=fq
                )
            self.linear_kv_down_proj = ReplicatedLinear(
                c.hidden_size,
                c.kv_lora_rank + c.qk_pos_emb_head_dim,
                config=c,
                init_method=c.init_method,
                fake_quant=fq,
            )

    return LocalMLASelfAttention


def _localize(spec, config, int4_precision: PrecisionConfig | None) -> None:
    """Rewrite the local block spec in place: SkyqRMSNorm for torch's norm, the MLA modules, and the
    fake-INT4 linears of `int4_precision.qat_scope` (None: bf16 linears)."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    spec.layer_norm = _swap(spec.layer_norm, {WrappedTorchNorm: SkyqRMSNorm})
    all_linear = int4_precision is not None and QuantScope(int4_precision.qat_scope) is QuantScope.all_linear
    if int4_precision is not None:
        col, row = fake_int4.local_int4_linears()
        int4_linears = {
            ColumnParallelLinear: ModuleSpec(module=col, params={"precision_cfg": int4_precision}),
            RowParallelLinear: ModuleSpec(module=row, params={"precision_cfg": int4_precision}),
        }
    for i, layer in enumerate(spec.layer_specs):
        layer = _swap(layer, {WrappedTorchNorm: SkyqRMSNorm})  # also a fresh copy per layer
        if all_linear:
            layer = _swap(layer, int4_linears)
        elif int4_precision is not None and layer.submodules.mlp.module is MoELayer:
            experts = layer.submodules.mlp.submodules.experts
            experts.submodules = _swap(experts.submodules, int4_linears)
        attention = layer.submodules.self_attention
        if attention.module is MLASelfAttention:
            attention.module = _local_mla_attention()
            attention.params = {**attention.params, "precision_cfg": int4_precision if all_linear else None}
            attention.submodules.core_attention = _swap(
                attention.submodules.core_attention, {DotProductAttention: _mla_core_attention()}
            )
            # MLASelfAttention.__init__ accepts only these classes here; LocalMLASelfAttention then
            # replaces both down-projections with ReplicatedLinear
            attention.submodules.linear_q_down_proj = ColumnParallelLinear
            attention.submodules.linear_kv_down_proj = ColumnParallelLinear
            if config.q_lora_rank is None:
                # no q down-projection, so no q norm: megatron-core 0.19 refuses a non-identity
                # q_layernorm without q_lora_rank (0.16.1 built it and never called it)
                from megatron.core.transformer.identity_op import IdentityOp

                attention.submodules.q_layernorm = IdentityOp
        spec.layer_specs[i] = layer


def _swap(node, mapping: dict):
    """`node` (a spec tree: ModuleSpec, submodule dataclasses, lists, classes) with every class in
    `mapping` replaced by its value; ModuleSpec / dataclass nodes are copied, not mutated."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    if isinstance(node, type):
        return mapping.get(node, node)
    if isinstance(node, ModuleSpec):
        new = mapping.get(node.module)
        if isinstance(new, ModuleSpec):
            return dataclasses.replace(new, params={**node.params, **new.params})
        return dataclasses.replace(
            node,
            module=new or node.module,
            submodules=_swap(node.submodules, mapping) if node.submodules is not None else None,
        )
    if isinstance(node, functools.partial):  # megatron-core 0.19's specs: partial(Module, submodules=...)
        keywords = {k: _swap(v, mapping) for k, v in node.keywords.items()}
        return functools.partial(mapping.get(node.func, node.func), *node.args, **keywords)
    if dataclasses.is_dataclass(node):
        changes = {f.name: _swap(getattr(node, f.name), mapping) for f in dataclasses.fields(node)}
        return dataclasses.replace(node, **changes)
    if isinstance(node, list):
        return [_swap(x, mapping) for x in node]
    return node


# --- TE spec (GPU) -----------------------------------------------------------------------------


def _module_of(node):
    """The module class a spec node builds: a ModuleSpec's `module` (0.16), a partial's `func` (0.19)."""
    if isinstance(node, functools.partial):
        return node.func
    return getattr(node, "module", node)


def _submodules_of(node):
    """A spec node's submodules: a ModuleSpec's `submodules`, a partial's `submodules=` keyword."""
    if isinstance(node, functools.partial):
        return node.keywords["submodules"]
    return node.submodules


def _bound(cls: type, precision_cfg: PrecisionConfig) -> type:
    """`cls` (a fake-INT4 TE linear taking `precision_cfg=`) with the precision bound: a class, which
    both 0.16's `build_module` and 0.19's direct calls construct."""

    def __init__(self, *args, **kwargs):
        cls.__init__(self, *args, precision_cfg=precision_cfg, **kwargs)

    return type(
        cls.__name__, (cls,), {"__init__": __init__, "__module__": cls.__module__, "__doc__": cls.__doc__}
    )


def _swap_te_experts(spec, precision_cfg: PrecisionConfig) -> None:
    """The routed experts' TE grouped linears -> fake-INT4 subclasses (`te_int4_grouped_linears`)."""
    from megatron.core.extensions.transformer_engine import (
        TEColumnParallelGroupedLinear,
        TERowParallelGroupedLinear,
    )
    from megatron.core.transformer.moe.moe_layer import MoELayer

    if QuantScope(precision_cfg.qat_scope) is not QuantScope.routed_experts:
        raise MegatronConfigError(
            f"precision.qat_scope={precision_cfg.qat_scope.value} on the GPU (TE spec): skyq's fake INT4 "
            "covers TE's grouped expert linears only. Fix: precision.qat_scope=routed_experts"
        )
    col, row = (_bound(cls, precision_cfg) for cls in fake_int4.te_int4_grouped_linears())
    # classes, not ModuleSpecs: megatron-core 0.19's TEGroupedMLP calls its linear classes directly
    mapping = {TEColumnParallelGroupedLinear: col, TERowParallelGroupedLinear: row}
    for i, layer in enumerate(spec.layer_specs):
        if _module_of(layer.submodules.mlp) is not MoELayer:
            continue
        # a fresh copy (layers share spec objects); only the routed experts use TE's grouped linears
        layer = spec.layer_specs[i] = _swap(layer, mapping)
        experts = _submodules_of(_submodules_of(layer.submodules.mlp).experts)
        fc1, fc2 = _module_of(experts.linear_fc1), _module_of(experts.linear_fc2)
        if fc1 is not col or fc2 is not row:
            raise MegatronConfigError(
                "precision=int4_qat: the TE spec's experts have no TEColumnParallelGroupedLinear / "
                "TERowParallelGroupedLinear to fake-quantize (moe_grouped_gemm off, or another "
                "megatron-core layout); the experts would train unquantized"
            )
