"""precision=int4_qat in Megatron: linears whose weight goes through skyq's INT4 fake-quant.

The forward multiplies by `fq(W)`: the weight rounded to bf16 (what the trainer sends; a no-op for
bf16 parameters) and fake-quantized by the precision's strategy (`int4_qat.fake_quant`: groups of
`precision.int4_group_size` along K, `precision.int4_grid`), cast back to the weight's dtype, as
the native trainer's `effective_parameters` does. The backward is a straight-through estimator:
the weight gradient is the gradient of `fq(W)`, unchanged (`dy^T x`, exactly).

The classes keep their parameters under the same names and shapes, so state dicts, DDP buffers and
dist-checkpointing see the plain Megatron layer. No global patching: `model.py` swaps them into the
layer spec (`precision.qat_scope`: the routed experts' linears, or every linear of the decoder).

- Local spec (CPU): `Int4ColumnParallelLinear` / `Int4RowParallelLinear` (SequentialMLP experts,
  attention, dense and shared MLPs) and `Int4ReplicatedLinear` (MLA down-projections, model.py).
- TE spec (GPU): `te_int4_grouped_linears()` gives subclasses of `TEColumnParallelGroupedLinear` /
  `TERowParallelGroupedLinear` overriding TE's `_get_weight_tensors`. With
  `gradient_accumulation_fusion` TE adds the weight gradient into `main_grad` itself, through the
  tensors it was given; `_FakeQuantWeight` hands the fake-quantized tensor the parameter's
  `main_grad` and flags the parameter `grad_added_to_main_grad` when TE returns no gradient, so
  Megatron's DDP hook neither misses the gradient nor adds it twice.
"""

from __future__ import annotations

import functools
import weakref

import torch
from torch import Tensor

from skyq.config.enums import Precision
from skyq.config.schema import PrecisionConfig
from skyq.quant.strategies import get_strategy


class Int4QatError(ValueError):
    """A layer the INT4 fake-quant cannot take as configured."""


class _FakeQuantWeight(torch.autograd.Function):
    """Forward: `quantize(weight)` (fq, computed here, outside autograd); backward: the incoming
    gradient to `weight` unchanged, in the weight's dtype.

    Megatron's DDP gives each parameter a `main_grad` buffer. The fake-quantized tensor gets the
    same `main_grad` (and no `grad_added_to_main_grad`), so TE's fused wgrad accumulation adds the
    weight gradient straight into the parameter's buffer and, for a tensor without that flag,
    returns no gradient (TE 2.20 grouped_linear.py). That arrives here as None (grads are not
    materialised): the parameter is flagged `grad_added_to_main_grad` and handed a zero gradient,
    so DDP's hook (which asserts a gradient under overlap_grad_reduce) fires and adds nothing.
    A flag TE would set on the fake-quantized tensor itself could not be read back here: TE frees
    what it saved, and with it that tensor, before this backward runs.
    """

    @staticmethod
    def forward(ctx, weight: Tensor, quantize) -> Tensor:
        ctx.set_materialize_grads(False)
        out = quantize(weight)
        ctx.weight_dtype = weight.dtype
        ctx.fused_weight = None
        if hasattr(weight, "main_grad"):
            out.main_grad = weight.main_grad
            ctx.fused_weight = weakref.ref(weight)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor | None):
        weight = ctx.fused_weight() if ctx.fused_weight is not None else None
        if grad is None:
            if weight is None:
                return None, None
            weight.grad_added_to_main_grad = True
            return torch.zeros_like(weight), None
        if weight is not None:
            weight.grad_added_to_main_grad = False
        return grad.to(ctx.weight_dtype), None


class Int4FakeQuant:
    """`fq` of one precision: `__call__(weight, name)` -> fq(weight) with the straight-through
    gradient. Built once per layer from the precision config (`int4_qat` only)."""

    def __init__(self, precision_cfg: PrecisionConfig) -> None:
        if Precision(precision_cfg.name) is not Precision.int4_qat:
            raise Int4QatError(f"fake INT4 layers need precision=int4_qat, got {precision_cfg.name}")
        self.strategy = get_strategy(precision_cfg)
        self.group_size = precision_cfg.int4_group_size

    def value(self, weight: Tensor, name: str = "weight") -> Tensor:
        """fq(weight) without autograd: the bf16 rounding, fake-quantized, in the weight's dtype."""
        with torch.no_grad():
            sent = weight.detach().to(torch.bfloat16)
            return self.strategy.fake_quant(sent, name=name).to(weight.dtype)

    def __call__(self, weight: Tensor, name: str = "weight") -> Tensor:
        if weight.dim() != 2:
            raise Int4QatError(
                f"{name}: the INT4 fake-quant takes one 2-D weight per linear, got shape {tuple(weight.shape)} "
                "(TE's single_grouped_weight=True packs all experts in one tensor; keep it off)"
            )
        if weight.shape[1] % self.group_size:
            raise Int4QatError(
                f"{name}: the local shard's K = {weight.shape[1]} is not a multiple of precision.int4_group_size="
                f"{self.group_size}, so a group would straddle two tensor-parallel shards. Fix: a group size "
                "dividing K / tp (or K / etp for experts), or a smaller tp / etp"
            )
        return _FakeQuantWeight.apply(weight, functools.partial(self.value, name=name))


def _wrap_forward_impl(layer, fq: Int4FakeQuant, name: str) -> None:
    """Route the weight a Megatron `ColumnParallelLinear` / `RowParallelLinear` passes to its matmul
    (`self._forward_impl(input=..., weight=..., ...)`, set in their `__init__`) through `fq`."""
    if layer.config.gradient_accumulation_fusion:
        raise Int4QatError(
            f"{name}: the local spec's fused weight-gradient accumulation writes into the parameter's "
            "main_grad inside the matmul and cannot see a fake-quantized weight; it is a GPU path, where "
            "skyq builds the TE spec (gradient_accumulation_fusion is on only with device=cuda)"
        )
    impl = layer._forward_impl

    def forward_impl(*args, weight: Tensor, **kwargs):
        return impl(*args, weight=fq(weight, name), **kwargs)

    layer._forward_impl = forward_impl


def _local_classes():
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    class Int4ColumnParallelLinear(ColumnParallelLinear):
        """`ColumnParallelLinear` computing with fq(weight) (precision=int4_qat)."""

        def __init__(self, *args, precision_cfg: PrecisionConfig, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            _wrap_forward_impl(self, Int4FakeQuant(precision_cfg), type(self).__name__)

    class Int4RowParallelLinear(RowParallelLinear):
        """`RowParallelLinear` computing with fq(weight) (precision=int4_qat)."""

        def __init__(self, *args, precision_cfg: PrecisionConfig, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            _wrap_forward_impl(self, Int4FakeQuant(precision_cfg), type(self).__name__)

    return Int4ColumnParallelLinear, Int4RowParallelLinear


@functools.cache
def local_int4_linears() -> tuple[type, type]:
    """(Int4ColumnParallelLinear, Int4RowParallelLinear): the local spec's fake-INT4 linears; their
    constructors take the extra keyword `precision_cfg` (the spec passes it through `ModuleSpec.params`)."""
    return _local_classes()


@functools.cache
def te_int4_grouped_linears() -> tuple[type, type]:
    """(Int4TEColumnParallelGroupedLinear, Int4TERowParallelGroupedLinear): TE's grouped expert linears
    whose `_get_weight_tensors()` returns fq of each expert's weight (GPU; imports Transformer Engine).
    Constructors take the extra keyword `precision_cfg`."""
    from megatron.core.extensions.transformer_engine import (
        TEColumnParallelGroupedLinear,
        TERowParallelGroupedLinear,
    )

    def make(base: type) -> type:
        class Int4Grouped(base):
            def __init__(self, *args, precision_cfg: PrecisionConfig, **kwargs) -> None:
                super().__init__(*args, **kwargs)
                self.skyq_fake_quant = Int4FakeQuant(precision_cfg)

            def _get_weight_tensors(self):
                weights = super()._get_weight_tensors()
                return [
                    self.skyq_fake_quant(w, f"{type(self).__name__}.weight{i}") for i, w in enumerate(weights)
                ]

        Int4Grouped.__name__ = Int4Grouped.__qualname__ = f"Int4{base.__name__}"
        Int4Grouped.__doc__ = (
            f"`{base.__name__}` computing with fq of each expert's weight (precision=int4_qat)."
        )
        return Int4Grouped

    return make(TEColumnParallelGroupedLinear), make(TERowParallelGroupedLinear)
