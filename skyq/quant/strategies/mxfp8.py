"""MXFP8: e4m3 codes + one uint8 E8M0 exponent per 1 x 32 block along K (compressed-tensors layout).

Scope: `precision.mxfp8_targets` (routed experts by default — the expert-only MXFP8 recipe). K must
be a multiple of 32: the trainer's MXFP8 GEMMs cannot take anything else, and the plan refuses such
a weight at build time with the arithmetic.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from skyq.config.enums import Fp8Recipe, Precision
from skyq.quant import dtype_names
from skyq.quant.layouts import Role
from skyq.quant.strategies.base import (
    LINEAR_SCOPE,
    QuantizationStrategy,
    StrategyError,
    WireSpec,
    register_strategy,
)

if TYPE_CHECKING:
    import torch
    from torch import Tensor

    from skyq.quant.plan import QuantPlan

MX_BLOCK = 32


def _mx_scheme(dynamic: bool) -> dict[str, object]:
    """compressed-tensors QuantizationArgs of an MXFP8 tensor (8-bit float, groups of 32, E8M0 uint8)."""
    return {
        "num_bits": 8,
        "type": "float",
        "symmetric": True,
        "group_size": MX_BLOCK,
        "strategy": "group",
        "dynamic": dynamic,
        "scale_dtype": "torch.uint8",
    }


@register_strategy
class Mxfp8Strategy(QuantizationStrategy):
    precision = Precision.mxfp8
    format_name = "mxfp8"
    wire_suffixes = ("weight", "weight_scale")

    @property
    def quantized_roles(self) -> frozenset[Role]:
        return LINEAR_SCOPE[self.precision_cfg.mxfp8_targets]

    def block(self) -> tuple[int, int]:
        return (1, MX_BLOCK)

    def wire_settings(self) -> dict[str, object]:
        return {"block_size": [1, MX_BLOCK], "scale_rule": "e8m0_round_up"}

    def _quantized_wire_specs(self, stem: str, shape: tuple[int, ...]) -> list[WireSpec]:
        n, k = shape
        if k % MX_BLOCK:
            from skyq.quant.errors import QuantizationError

            raise QuantizationError(
                f"{stem}weight: MXFP8 needs K % {MX_BLOCK} == 0, but K = {k} = {k // MX_BLOCK} * {MX_BLOCK} + "
                f"{k % MX_BLOCK} (shape {shape}); narrow precision.mxfp8_targets or leave this module bf16"
            )
        return [
            WireSpec(stem + "weight", (n, k), dtype_names.FP8_E4M3),
            WireSpec(stem + "weight_scale", (n, k // MX_BLOCK), dtype_names.UINT8),
        ]

    def _encode(self, stem: str, tensor: Tensor) -> dict[str, Tensor]:
        from skyq.quant.kernels import dispatch

        q, scale = dispatch.quantize_mxfp8(tensor, name=stem + "weight")
        return {stem + "weight": q, stem + "weight_scale": scale}

    def _encode_stack(self, stems: Sequence[str], stack: Tensor) -> tuple[Tensor, ...]:
        from skyq.quant.kernels import dispatch

        return dispatch.quantize_mxfp8(stack, name=stems[0] + "weight")

    grouped_quantizer = True

    def _quantize_group(
        self, inputs: Sequence[Tensor], names: Sequence[str], out: Sequence[tuple[Tensor, ...]] | None = None
    ) -> list[tuple[Tensor, ...]]:
        """`dispatch.quantize_mxfp8_group` (one launch on CUDA)."""
        from skyq.quant.kernels import dispatch

        return dispatch.quantize_mxfp8_group(inputs, names, out=out)  # type: ignore[arg-type]

    def _decode(self, stem: str, wire: Mapping[str, Tensor], dtype: torch.dtype) -> Tensor:
        from skyq.quant.kernels import dispatch

        # the Triton kernel on CUDA (same bits; its checks deferred inside a deferred-checks scope)
        return dispatch.dequantize_mxfp8(
            wire[stem + "weight"], wire[stem + "weight_scale"], dtype=dtype, name=stem + "weight"
        )

    def fake_quant(self, tensor: Tensor, *, name: str = "weight") -> Tensor:
        from skyq.quant import fake_quant

        return fake_quant.fake_quant_mxfp8(tensor, name=name)

    def quantization_config(self, plan: QuantPlan) -> dict[str, object]:
        """compressed-tensors `mxfp8-quantized`: MX weights and dynamic MX activations (as trained)."""
        self._check_plan(plan)
        return {
            "quant_method": "compressed-tensors",
            "format": "mxfp8-quantized",
            "quantization_status": "compressed",
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": _mx_scheme(dynamic=False),
                    "input_activations": _mx_scheme(dynamic=True),
                }
            },
            "ignore": plan.ignore_list(),
            "kv_cache_scheme": None,
        }

    def te_recipe_kwargs(self) -> dict[str, object]:
        """TE `MXFP8BlockScaling` (E4M3 everywhere, 1x32 blocks, E8M0 scales)."""
        return {"recipe": "MXFP8BlockScaling", "fp8_format": "E4M3"}

    def env_vars(self, resolved_recipe: Fp8Recipe) -> dict[str, dict[str, str]]:
        """MXFP8 needs no environment switch; it needs SM100+ unless `precision.emulate` is set.

        A worker that resolved `blockwise` is a pre-SM100 device: real MXFP8 GEMMs do not exist
        there, so the run is refused unless exact emulation was asked for.
        """
        env = super().env_vars(resolved_recipe)
        if resolved_recipe is Fp8Recipe.blockwise and not self.precision_cfg.emulate:
            raise StrategyError(
                "precision.name=mxfp8 on workers that resolved fp8_recipe=blockwise (a pre-SM100 GPU): "
                "MXFP8 GEMMs need SM100+; set precision.emulate=true to run it by exact emulation"
            )
        return env
