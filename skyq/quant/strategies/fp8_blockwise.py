"""FP8 blockwise: e4m3 codes + fp32 `weight_scale_inv` per bn x bk block (DeepSeek-V3 layout).

Scope: `precision.fp8_targets` (all_linear by default: attention, dense MLP, shared and routed
experts). Scales are powers of two exactly when `precision.scale_format=ue8m0`, and only then does
the checkpoint say `scale_fmt: ue8m0` (FORMATS.md; a flag over non-pow2 scales is pitfall P2).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from skyq.config.enums import Fp8Recipe, Precision, ScaleFormat
from skyq.config.schema import PrecisionConfig
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


@register_strategy
class Fp8BlockwiseStrategy(QuantizationStrategy):
    precision = Precision.fp8_blockwise
    format_name = "fp8_blockwise"
    wire_suffixes = ("weight", "weight_scale_inv")

    def __init__(self, precision_cfg: PrecisionConfig) -> None:
        super().__init__(precision_cfg)
        block = list(precision_cfg.block_size)
        if len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block):
            raise StrategyError(f"precision.block_size={block!r}: expected [rows, cols] of two positive ints")
        self.block_size: tuple[int, int] = (block[0], block[1])
        self.pow2_scale = precision_cfg.scale_format is ScaleFormat.ue8m0

    @property
    def quantized_roles(self) -> frozenset[Role]:
        return LINEAR_SCOPE[self.precision_cfg.fp8_targets]

    def block(self) -> tuple[int, int]:
        return self.block_size

    def wire_settings(self) -> dict[str, object]:
        return {"block_size": list(self.block_size), "scale_format": self.precision_cfg.scale_format.value}

    def _quantized_wire_specs(self, stem: str, shape: tuple[int, ...]) -> list[WireSpec]:
        (bn, bk), (n, k) = self.block_size, shape
        return [
            WireSpec(stem + "weight", (n, k), dtype_names.FP8_E4M3),
            WireSpec(stem + "weight_scale_inv", (math.ceil(n / bn), math.ceil(k / bk)), dtype_names.FP32),
        ]

    def _encode(self, stem: str, tensor: Tensor) -> dict[str, Tensor]:
        from skyq.quant.kernels import dispatch

        q, scale_inv = dispatch.quantize_fp8_blockwise(
            tensor, block_size=self.block_size, pow2_scale=self.pow2_scale, name=stem + "weight"
        )
        return {stem + "weight": q, stem + "weight_scale_inv": scale_inv}

    def _encode_stack(self, stems: Sequence[str], stack: Tensor) -> tuple[Tensor, ...]:
        from skyq.quant.kernels import dispatch

        return dispatch.quantize_fp8_blockwise(
            stack, block_size=self.block_size, pow2_scale=self.pow2_scale, name=stems[0] + "weight"
        )

    grouped_quantizer = True

    def _quantize_group(
        self, inputs: Sequence[Tensor], names: Sequence[str], out: Sequence[tuple[Tensor, ...]] | None = None
    ) -> list[tuple[Tensor, ...]]:
        """`dispatch.quantize_fp8_blockwise_group` (one launch on CUDA)."""
        from skyq.quant.kernels import dispatch

        return dispatch.quantize_fp8_blockwise_group(
            inputs,
            names,
            block_size=self.block_size,
            pow2_scale=self.pow2_scale,
            out=out,  # type: ignore[arg-type]
        )

    def _decode(self, stem: str, wire: Mapping[str, Tensor], dtype: torch.dtype) -> Tensor:
        from skyq.quant.kernels import dispatch

        # the Triton kernel on CUDA (same bits; its checks deferred inside a deferred-checks scope)
        return dispatch.dequantize_fp8_blockwise(
            wire[stem + "weight"], wire[stem + "weight_scale_inv"], block_size=self.block_size,
            dtype=dtype, name=stem + "weight",
        )  # fmt: skip

    def fake_quant(self, tensor: Tensor, *, name: str = "weight") -> Tensor:
        from skyq.quant import fake_quant

        return fake_quant.fake_quant_fp8_blockwise(tensor, self.block_size, self.pow2_scale, name=name)

    def quantization_config(self, plan: QuantPlan) -> dict[str, object]:
        """DeepSeek-V3 / vLLM / SGLang / transformers FineGrainedFP8 block config."""
        self._check_plan(plan)
        config: dict[str, object] = {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": list(self.block_size),
            "modules_to_not_convert": plan.unquantized_linear_modules(),
        }
        if self.pow2_scale:
            config["scale_fmt"] = "ue8m0"
        return config

    def te_recipe_kwargs(self) -> dict[str, object]:
        """TE `Float8BlockScaling`: 1x128 activation tiles, 128x128 weight blocks.

        `use_f32_scales` is not a constructor argument: TE reads it from
        NVTE_FP8_BLOCK_SCALING_FP32_SCALES at import time (see `env_vars`); the trainer asserts
        the imported class attribute equals it. `fp8_param` is Megatron's persistent-FP8-weights switch.
        """
        return {
            "recipe": "Float8BlockScaling",
            "fp8_format": "E4M3",
            "use_f32_scales": not self.pow2_scale,
            "fp8_param": self.precision_cfg.persistent_fp8_params,
        }

    def env_vars(self, resolved_recipe: Fp8Recipe) -> dict[str, dict[str, str]]:
        """NVTE_FP8_BLOCK_SCALING_FP32_SCALES (trainer) and VLLM_USE_DEEP_GEMM_E8M0 (engine).

        - NVTE_FP8_BLOCK_SCALING_FP32_SCALES: TE's Float8BlockScaling rounds scales to powers of two
          unless this is "1"; it must match `scale_format` or the trainer's forward quantizes on a
          different grid than the weights pushed to the engine. Read at TE import time.
        - VLLM_USE_DEEP_GEMM_E8M0: when "1", vLLM re-quantizes weight block scales to E8M0 for
          DeepGEMM and quantizes activations with power-of-two scales (`per_token_group_quant_fp8`).
          It follows `scale_format`: "1" for ue8m0, whose weight scales convert losslessly and whose
          trainer quantizes activations with the same power-of-two rule (vLLM itself turns it on for
          a `scale_fmt: ue8m0` checkpoint unless it is set); "0" for fp32, which E8M0 would round (a
          mismatch). SM100+ DeepGEMM (resolved recipe mxfp8) only takes E8M0, so fp32 is refused there.
        """
        super().env_vars(resolved_recipe)
        if resolved_recipe is Fp8Recipe.mxfp8 and not self.pow2_scale:
            raise StrategyError(
                "precision.name=fp8_blockwise with precision.scale_format=fp32 on workers that resolved "
                "fp8_recipe=mxfp8 (SM100+): Blackwell DeepGEMM and TE's MX-emulated blockwise need "
                "power-of-two scales; set precision.scale_format=ue8m0"
            )
        return {
            "trainer": {"NVTE_FP8_BLOCK_SCALING_FP32_SCALES": "0" if self.pow2_scale else "1"},
            "engine": {"VLLM_USE_DEEP_GEMM_E8M0": "1" if self.pow2_scale else "0"},
        }
