"""Engine modules that hold weights exactly as they arrive on the wire and dequantize per forward.

`WireLinear` keeps a quantized linear's wire units as buffers named like the wire tensors
(`weight` e4m3 + `weight_scale_inv`; `weight` e4m3 + `weight_scale` uint8; `weight_packed` int32 +
`weight_scale` bf16 + `weight_shape`), so the model's state dict IS the wire state. Its forward asks
the strategy to dequantize (the same `deserialize` the plan and tests use) and multiplies; no
dequantized copy outlives the call. On CUDA, decode-sized inputs of an FP8 blockwise weight go to the
weight-only Triton kernel instead (`dispatch.fp8_weight_only_linear`): the e4m3 codes are read and
dequantized in registers, so decode never materializes a bf16 weight. FP8 recipes quantize the
input activations too, as the engine's W8A8 GEMM does. `WireExperts` is the routed-experts block over per-expert linears, one module per
HF tensor (`experts.{e}.{gate,up,down}_proj`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from skyq.config.enums import Precision
from skyq.quant.kernels import dispatch
from skyq.quant.layouts import Role
from skyq.quant.strategies import QuantizationStrategy, WireSpec

TensorFn = Callable[[Tensor], Tensor]

DECODE_MAX_ROWS = 64
"""Largest row count (tokens in one forward) sent to the FP8 weight-only decode kernel."""


class WireLinear(nn.Module):
    """A bias-free linear whose weight lives as wire tensors; dequantized inside `forward`."""

    def __init__(
        self,
        hf_name: str,
        role: Role,
        specs: list[WireSpec],
        strategy: QuantizationStrategy,
        activation: TensorFn | None,
    ) -> None:
        super().__init__()
        self.hf_name = hf_name
        self.role = role
        self.stem = hf_name.removesuffix("weight")
        self.strategy = strategy
        self.activation = activation
        for spec in specs:
            if not spec.name.startswith(self.stem):
                raise ValueError(f"{spec.name}: wire tensor of {hf_name} outside its module")
            self.register_buffer(spec.name[len(self.stem) :], torch.zeros(spec.shape, dtype=spec.dtype))

    def wire(self) -> dict[str, Tensor]:
        return {self.stem + leaf: buffer for leaf, buffer in self._buffers.items()}

    def forward(self, x: Tensor) -> Tensor:
        if self.activation is not None:
            x = self.activation(x)
        if self._decodes_from_fp8(x):
            # e4m3 codes and block scales read and dequantized in registers: no dequantized weight
            return dispatch.fp8_weight_only_linear(
                x, self._buffers["weight"], self._buffers["weight_scale_inv"], self.strategy.block()
            )
        weight = self.strategy.deserialize(self.hf_name, self.wire(), role=self.role, dtype=x.dtype)
        return F.linear(x, weight)

    def _decodes_from_fp8(self, x: Tensor) -> bool:
        """Decode-sized bf16 inputs of an FP8 blockwise weight on CUDA take the weight-only kernel;
        prefill (more than DECODE_MAX_ROWS rows) and CPU dequantize and use the regular GEMM."""
        return (
            x.is_cuda
            and x.dtype == torch.bfloat16
            and self.strategy.precision is Precision.fp8_blockwise
            and x.numel() // max(x.shape[-1], 1) <= DECODE_MAX_ROWS
        )

    def extra_repr(self) -> str:
        return ", ".join(f"{leaf}={tuple(b.shape)}:{b.dtype}" for leaf, b in self._buffers.items())


class ExpertMLP(nn.Module):
    """One routed expert: down(act(gate(x)) * up(x))."""

    def __init__(
        self, gate_proj: nn.Module, up_proj: nn.Module, down_proj: nn.Module, act_fn: TensorFn
    ) -> None:
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = gate_proj, up_proj, down_proj
        self.act_fn = act_fn

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class WireExperts(nn.ModuleList):
    """Routed experts as a list of `ExpertMLP` (names `<layer>.mlp.experts.{e}.<proj>`), called like
    transformers' fused experts module: (hidden [T, H], top_k_index [T, k], top_k_weights [T, k])."""

    def forward(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        out = torch.zeros_like(hidden_states)
        for expert in torch.unique(top_k_index).tolist():
            token_idx, k_pos = torch.where(top_k_index == expert)
            expert_out = self[expert](hidden_states[token_idx]) * top_k_weights[token_idx, k_pos, None]
            out.index_add_(0, token_idx, expert_out.to(out.dtype))
        return out


def plain_linear(shape: tuple[int, ...], dtype: torch.dtype) -> nn.Linear:
    """An unquantized bias-free linear of weight shape (out, in), zero-filled until weights load."""
    linear = nn.Linear(shape[1], shape[0], bias=False, dtype=dtype)
    nn.init.zeros_(linear.weight)
    return linear.requires_grad_(False)
