"""The native trainer's precision: effective weights from the strategy + an activation-quant rewrite.

Weights. The forward never reads the fp32 master parameters directly: it runs on
`effective_parameters()`, where every parameter is rounded to bf16 (what `hf_weights()` sends) and,
if the precision's strategy quantizes it, fake-quantized by `strategy.fake_quant_param` (per expert
and per projection for fused experts, straight-through gradient). So the trainer computes with
exactly the values the rollout engine dequantizes from the wire — bit for bit.

Activations. FP8 recipes also quantize the inputs of the linears they quantize (1 x tile FP8
blockwise, 1 x 32 MXFP8): the exact CPU emulation of an FP8 GEMM. The quantizer is applied to the
bf16 rounding of the fp32 activation (`engine_precision_input`), the operand a W8A8 engine (and
the FP8 GEMM path below) quantizes; the dequantized activation and the matmul stay fp32. That
part is a module rewrite: those `nn.Linear`s become `ActivationQuantLinear` and those fused expert
modules `ActivationQuantExperts`, keeping their parameters under the same names. INT4 QAT is
W4A16: no activation quantization. bf16 quantizes nothing. On a GPU with bf16 grouped GEMMs the fused
experts those precisions leave as transformers' become `RoutedExperts` (`route_experts`): the engine's
grouped formulation with nothing quantized, so the trainer's bf16 log-probs are the engine's bits too.

FP8 GEMMs. With precision=fp8_blockwise (128 x 128 weight blocks, 1 x 128 activation tiles) and
`trainer.fp8_gemm` active, the quantized linears run through `skyq.trainer.fp8_linear` instead:
forward, dgrad and wgrad as blockwise FP8 GEMMs (cuBLAS on SM90, or its fp32 emulation), inputs in
bf16 as on a GPU trainer. The weight they quantize is the effective (already fake-quantized) one, and
re-quantizing an FP8 blockwise value gives the same codes, so the forward still computes with the
engine's weights; what changes is that the gradients are FP8 GEMMs too (the DeepSeek-V3 / TE
recipe) rather than the straight-through fp32 ones. Layers whose features are not multiples of 16
(cuBLAS FP8 rows) keep the fake-quant path.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from skyq.config.enums import Precision
from skyq.config.schema import ModelConfig, PrecisionConfig
from skyq.ops.grouped_mm import bf16_grouped_linear, bf16_grouped_mm_on
from skyq.ops.moe_combine import combine_reference
from skyq.ops.moe_route import route
from skyq.quant.fake_quant import activation_fake_quant
from skyq.quant.kernels import dispatch
from skyq.quant.layouts import ModelQuantizationLayout
from skyq.quant.strategies import QuantizationStrategy
from skyq.trainer.native.model import hf_dtype

TensorFn = Callable[[Tensor], Tensor]


class _StraightThrough(torch.autograd.Function):
    """Forward: `value` (itself, no copy); backward: the incoming gradient goes to `master`
    unchanged, in the master's dtype.

    This is the quantizer's straight-through estimator, applied to the bf16 rounding and the
    fake-quant together. The gradient is cast to the master's dtype here, exactly; the caller sums
    the micro-batches' gradients in that dtype (a sum through `.to(bfloat16)` would be rounded to
    bf16 and differ with the micro-batch split).
    """

    @staticmethod
    def forward(ctx, master: Tensor, value: Tensor) -> Tensor:
        ctx.master_dtype = master.dtype
        return value

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        return grad.to(ctx.master_dtype), None


def effective_parameters(
    params: dict[str, Tensor],
    *,
    strategy: QuantizationStrategy,
    layout: ModelQuantizationLayout,
    model_cfg: ModelConfig,
    dtype: torch.dtype | None = None,
) -> dict[str, Tensor]:
    """{trainer name: the value the forward uses}: the master rounded to its checkpoint dtype (bf16;
    fp32 for DeepSeek-V3's router bias, which stays fp32 whatever `dtype` is) and fake-quantized
    where the strategy quantizes it, in `dtype` (default the master's; exact either way, bf16
    values are fp32 values), with a straight-through gradient to the master in the master's dtype."""
    out = {}
    for name, master in params.items():
        wire_dtype = hf_dtype(layout, name, model_cfg)
        with torch.no_grad():
            sent = master.detach().to(wire_dtype)
            value = strategy.fake_quant_param(name, sent, layout=layout, model_cfg=model_cfg)
            value = value.to(torch.float32 if wire_dtype == torch.float32 else dtype or master.dtype)
        out[name] = _StraightThrough.apply(master, value)
    return out


def engine_precision_input(x: Tensor) -> Tensor:
    """`x` rounded to bf16 (the engine's activation dtype) in the forward, in x's dtype; the
    gradient reaches `x` unchanged (straight through, like the quantizer's own STE).

    A W8A8 engine quantizes bf16 activations, so the trainer's activation quantizer is applied to
    the bf16 rounding of its fp32 activation: an input that rounds to the engine's value then gets
    the engine's codes and tile scale exactly. Quantizing the fp32 value instead lets an element
    within half a bf16 ulp of the engine's land on the other side of an e4m3 rounding boundary —
    with power-of-two scales (MXFP8, `scale_format=ue8m0`) every e4m3 midpoint is a bf16 value,
    so 1 in 16 engine activations is an exact tie that the fp32 trainer breaks at random.
    """
    if x.dtype == torch.bfloat16:
        return x
    return _StraightThrough.apply(x, x.detach().to(torch.bfloat16).to(x.dtype))


class ActivationQuantLinear(nn.Module):
    """A bias-free linear whose input, rounded to bf16 (`engine_precision_input`), is
    fake-quantized before the matmul."""

    def __init__(self, linear: nn.Linear, activation: TensorFn) -> None:
        super().__init__()
        if linear.bias is not None:
            raise ValueError(
                "ActivationQuantLinear supports bias-free linears only (Qwen3-MoE and DeepSeek-V3 have none)"
            )
        self.weight = linear.weight
        self.activation = activation

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(self.activation(engine_precision_input(x)), self.weight.to(x.dtype))


def check_expert_range(top_k_index: Tensor, num_experts: int) -> None:
    """Raise if the router chose an expert the layer does not have. On CUDA inside
    `dispatch.deferred_finite_checks` the device flag is read with the scope's others (before the
    trainer's optimizer step), not synced here: an out-of-range index only leaves its rows out of the
    sorted experts' ranges (`moe_route.route`), nothing is read or written out of bounds."""
    if not top_k_index.numel():
        return

    def validate() -> None:
        top = int(top_k_index.max())
        if top >= num_experts:
            raise ValueError(f"router chose expert {top} of a layer with {num_experts} experts")

    dispatch.check_flag_deferred(top_k_index.max() >= num_experts, validate)


def routed_experts_forward(
    hidden_states: Tensor,
    top_k_index: Tensor,
    top_k_weights: Tensor,
    *,
    gate_up: Callable[[int, Tensor], Tensor],
    down: Callable[[int, Tensor], Tensor],
    act_fn: TensorFn,
    num_experts: int,
) -> Tensor:
    """Routed-expert mixing (Qwen3-MoE and DeepSeek-V3 alike): each token through its top-k experts,
    weighted by the router, summed.

    `gate_up(e, x)` returns expert e's [gate | up] projections of rows x, `down(e, h)` its output.
    """
    check_expert_range(top_k_index, num_experts)
    out = torch.zeros_like(hidden_states)
    for expert in torch.unique(top_k_index).tolist():
        token_idx, k_pos = torch.where(top_k_index == expert)
        gate, up = gate_up(expert, hidden_states[token_idx]).chunk(2, dim=-1)
        expert_out = down(expert, act_fn(gate) * up) * top_k_weights[token_idx, k_pos, None]
        out.index_add_(0, token_idx, expert_out.to(out.dtype))
    return out


class _QuantizedExperts(nn.Module, ABC):
    """Fused routed experts (parameters kept under their names) whose per-expert projections go
    through `_linear(x, weight)`."""

    def __init__(self, experts: nn.Module) -> None:
        super().__init__()
        self.gate_up_proj = experts.gate_up_proj
        self.down_proj = experts.down_proj
        self.act_fn = experts.act_fn
        self.num_experts = experts.num_experts

    @abstractmethod
    def _linear(self, x: Tensor, weight: Tensor) -> Tensor:
        """One expert's projection of rows `x` by `weight` [out, in]."""

    def forward(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        gate_up, down = self.gate_up_proj, self.down_proj
        return routed_experts_forward(
            hidden_states, top_k_index, top_k_weights,
            gate_up=lambda e, x: self._linear(x, gate_up[e]),
            down=lambda e, h: self._linear(h, down[e]),
            act_fn=self.act_fn, num_experts=self.num_experts,
        )  # fmt: skip


class _RoutedExperts(_QuantizedExperts):
    """Fused routed experts computed as the engine computes them: on a GPU with bf16 grouped GEMMs
    (sm_90+) and bf16 compute, `grouped_forward`; elsewhere the per-expert loop. Each projection's
    input goes through `_input` first."""

    def _input(self, x: Tensor) -> Tensor:
        return x

    def _linear(self, x: Tensor, weight: Tensor) -> Tensor:
        return F.linear(self._input(x), weight.to(x.dtype))

    def forward(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        if (
            hidden_states.is_cuda
            and hidden_states.dtype == torch.bfloat16
            and bf16_grouped_mm_on(hidden_states.device)
        ):
            return self.grouped_forward(hidden_states, top_k_index, top_k_weights)
        return super().forward(hidden_states, top_k_index, top_k_weights)

    def grouped_forward(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        """The experts as two grouped GEMMs over the rows sorted by expert (`moe_route.route`), the
        engine prefill's formulation, instead of ~12 launches and a host sync per expert: the same
        rows through `_input` the same way (it is per row), and each token's expert outputs added in
        ascending expert order as the loop adds them (`combine_reference`, differentiable). No host
        sync: inside `deferred_finite_checks` (the trainer's steps and scoring) the expert-range
        check is read with the quantizers' flags."""
        check_expert_range(top_k_index, self.num_experts)
        order, _, offsets, token = route(top_k_index, self.num_experts)
        x = self._input(hidden_states[token])
        gate, up = bf16_grouped_linear(x, self.gate_up_proj.to(x.dtype), offsets).chunk(2, dim=-1)
        h = self._input(self.act_fn(gate) * up)
        down = bf16_grouped_linear(h, self.down_proj.to(h.dtype), offsets)
        return combine_reference(down, order, top_k_index, top_k_weights, hidden_states.dtype)


class ActivationQuantExperts(_RoutedExperts):
    """Fused routed experts whose gate_up and down inputs, rounded to bf16, are fake-quantized per
    token row. On a GPU with bf16 grouped GEMMs (sm_90+), bf16 compute: `grouped_forward`."""

    def __init__(self, experts: nn.Module, activation: TensorFn) -> None:
        super().__init__(experts)
        self.activation = activation

    def _input(self, x: Tensor) -> Tensor:
        return self.activation(engine_precision_input(x))


class RoutedExperts(_RoutedExperts):
    """Fused routed experts of a precision that quantizes no activation (bf16, INT4 QAT), on a GPU
    with bf16 grouped GEMMs and bf16 compute (`route_experts`): the engine prefill's formulation, so
    bf16 log-probs are the engine's bits, as FP8's are. transformers' own experts (its `grouped_mm`
    implementation by default) sort and sum the rows another way: on the H200 the bf16 trainer's
    log-probs differed from the engine's scoring by up to 0.02 nats on the one-GPU run's batch."""


def _replace_modules(model: nn.Module, replacements: list[tuple[str, nn.Module]]) -> list[str]:
    """Put each replacement in its named module's place; returns the names."""
    for name, replacement in replacements:
        parent_name, _, child = name.rpartition(".")
        model.get_submodule(parent_name).register_module(child, replacement)
    return [name for name, _ in replacements]


def route_experts(model: nn.Module) -> list[str]:
    """Rewrite, in place, the fused experts modules still transformers' own (those no activation
    quantizer took) as `RoutedExperts`, parameters under the same names. For a trainer on a GPU with
    bf16 grouped GEMMs and bf16 compute, where the engine runs its experts grouped; returns the
    rewritten module names."""
    replacements = [
        (name, RoutedExperts(module))
        for name, module in model.named_modules()
        if is_fused_experts(module) and not isinstance(module, _QuantizedExperts)
    ]
    return _replace_modules(model, replacements)


class Fp8GemmLinear(nn.Module):
    """A bias-free linear whose three GEMMs run in FP8 blockwise (see the module docstring)."""

    def __init__(self, linear: nn.Linear, *, emulate: bool) -> None:
        super().__init__()
        if linear.bias is not None:
            raise ValueError(
                "Fp8GemmLinear supports bias-free linears only (Qwen3-MoE and DeepSeek-V3 have none)"
            )
        self.weight = linear.weight
        self.emulate = emulate

    def forward(self, x: Tensor) -> Tensor:
        return _fp8_linear(x, self.weight, self.emulate)


class Fp8GemmExperts(_QuantizedExperts):
    """Fused routed experts whose per-expert gate_up and down GEMMs run in FP8 blockwise."""

    def __init__(self, experts: nn.Module, *, emulate: bool) -> None:
        super().__init__(experts)
        self.emulate = emulate

    def _linear(self, x: Tensor, weight: Tensor) -> Tensor:
        return _fp8_linear(x, weight, self.emulate)


def _fp8_linear(x: Tensor, weight: Tensor, emulate: bool) -> Tensor:
    """`F.linear(x, weight)` as FP8 blockwise GEMMs on bf16 operands, returned in x's dtype."""
    from skyq.trainer.fp8_linear import fp8_blockwise_linear

    return fp8_blockwise_linear(x.to(torch.bfloat16), weight.to(torch.bfloat16), emulate=emulate).to(x.dtype)


def fp8_gemm_applies(precision_cfg: PrecisionConfig) -> bool:
    """The FP8 GEMM path implements FP8 blockwise with 128 x 128 weight blocks and 1 x 128 tiles only."""
    return (
        Precision(precision_cfg.name) is Precision.fp8_blockwise
        and tuple(precision_cfg.block_size) == (128, 128)
        and precision_cfg.activation_tile == 128
    )


def _gemm_features_ok(shape: tuple[int, ...]) -> bool:
    from skyq.trainer.fp8_linear import ALIGN

    return shape[-1] % ALIGN == 0 and shape[-2] % ALIGN == 0


def is_fused_experts(module: nn.Module) -> bool:
    return isinstance(getattr(module, "gate_up_proj", None), Tensor) and isinstance(
        getattr(module, "down_proj", None), Tensor
    )


def quantize_activations(
    model: nn.Module,
    *,
    precision_cfg: PrecisionConfig,
    quantizes: Callable[[str, tuple[int, ...]], bool],
    fp8_gemm: bool | None = None,
) -> list[str]:
    """Rewrite, in place, the linears / expert modules whose weights are quantized so their inputs
    are too (FP8 recipes only). `quantizes(trainer_param_name, shape)` is the strategy's decision.
    `fp8_gemm`: None = fake quant; False = FP8 GEMMs through cuBLAS; True = FP8 GEMMs emulated in
    fp32 (FP8 blockwise only, see `fp8_gemm_applies`). Returns the rewritten module names."""
    activation = activation_fake_quant(precision_cfg)
    if activation is None:
        return []
    gemm = fp8_gemm is not None and fp8_gemm_applies(precision_cfg)
    replacements: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and quantizes(f"{name}.weight", tuple(module.weight.shape)):
            if gemm and _gemm_features_ok(tuple(module.weight.shape)):
                replacements.append((name, Fp8GemmLinear(module, emulate=bool(fp8_gemm))))
            else:
                replacements.append((name, ActivationQuantLinear(module, activation)))
        elif is_fused_experts(module) and quantizes(f"{name}.gate_up_proj", tuple(module.gate_up_proj.shape)):
            shapes_ok = _gemm_features_ok(tuple(module.gate_up_proj.shape)) and _gemm_features_ok(
                tuple(module.down_proj.shape)
            )
            if gemm and shapes_ok:
                replacements.append((name, Fp8GemmExperts(module, emulate=bool(fp8_gemm))))
            else:
                replacements.append((name, ActivationQuantExperts(module, activation)))
    return _replace_modules(model, replacements)
