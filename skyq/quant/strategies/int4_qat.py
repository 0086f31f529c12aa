"""INT4 QAT: bf16 forward with fake INT4 on the QAT scope, W4A16 `pack-quantized` on the wire.

Scope: `precision.qat_scope` (routed experts by default, as in Kimi-K2-Thinking / K2.6). The
trainer's fake-quant and the checkpoint's ignore list come from the same plan, so they cover the
same set. Symmetric only: asymmetric zero points are never written for QAT (FORMATS.md).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from skyq.config.enums import Precision
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

CODES_PER_WORD = 8
"""INT4 codes per int32 word of `weight_packed` (`int4.CODES_PER_WORD`, which imports torch; a test
checks they agree)."""


@register_strategy
class Int4QatStrategy(QuantizationStrategy):
    precision = Precision.int4_qat
    format_name = "int4"
    wire_suffixes = ("weight_packed", "weight_scale", "weight_shape")

    def __init__(self, precision_cfg: PrecisionConfig) -> None:
        super().__init__(precision_cfg)
        g = precision_cfg.int4_group_size
        if not isinstance(g, int) or g <= 0:
            raise StrategyError(f"precision.int4_group_size={g!r}: expected a positive int (32 or 128)")
        self.group_size = g
        self._shape_rows: dict[tuple[int, int, int, torch.device], Tensor] = {}
        """`weight_shape` rows per (N, K, members, device) for `_quantize_group`: made once, never written."""

    @property
    def quantized_roles(self) -> frozenset[Role]:
        return LINEAR_SCOPE[self.precision_cfg.qat_scope]

    def block(self) -> tuple[int, int]:
        return (1, self.group_size)

    def wire_settings(self) -> dict[str, object]:
        return {"group_size": self.group_size, "grid": self.precision_cfg.int4_grid.value, "symmetric": True}

    def _quantized_wire_specs(self, stem: str, shape: tuple[int, ...]) -> list[WireSpec]:
        n, k = shape
        g = self.group_size
        if k % g:
            from skyq.quant.errors import QuantizationError

            raise QuantizationError(
                f"{stem}weight: INT4 needs K % group_size == 0, but K = {k} = {k // g} * {g} + {k % g} "
                f"(shape {shape}, precision.int4_group_size={g}); pick a group size dividing {k}"
            )
        return [
            WireSpec(stem + "weight_packed", (n, math.ceil(k / CODES_PER_WORD)), dtype_names.INT32),
            WireSpec(stem + "weight_scale", (n, k // g), dtype_names.BF16),
            WireSpec(stem + "weight_shape", (2,), dtype_names.INT64),
        ]

    def _encode(self, stem: str, tensor: Tensor) -> dict[str, Tensor]:
        from skyq.quant import int4
        from skyq.quant.kernels import dispatch

        name = stem + "weight"
        packed, scale = dispatch.quantize_int4_packed(
            tensor, group_size=self.group_size, grid=self.precision_cfg.int4_grid, name=name
        )
        n, k = tensor.shape
        return {
            stem + "weight_packed": packed,
            stem + "weight_scale": scale,
            stem + "weight_shape": int4.weight_shape_tensor(n, k),
        }

    def _encode_stack(self, stems: Sequence[str], stack: Tensor) -> tuple[Tensor, ...]:
        from skyq.quant.kernels import dispatch

        packed, scale = dispatch.quantize_int4_packed(
            stack, group_size=self.group_size, grid=self.precision_cfg.int4_grid, name=stems[0] + "weight"
        )
        # The shapes as rows of one [E, 2] tensor on the stack's device: no per-expert host tensor
        # that the bucket would copy to the device one at a time, and the rows lie back to back.
        return packed, scale, self._shape_row(stack)

    grouped_quantizer = True

    def _quantize_group(
        self, inputs: Sequence[Tensor], names: Sequence[str], out: Sequence[tuple[Tensor, ...]] | None = None
    ) -> list[tuple[Tensor, ...]]:
        """`dispatch.quantize_int4_packed_group` (one launch on CUDA), with the `weight_shape`
        tensors kept on the input's device between calls: a host tensor copied to the GPU waits for
        the stream (a blocking copy), once per matrix and stack of every sync otherwise. They are
        shared by every sync and never written (the sender only reads wire tensors); into `out`
        they are copied by one multi-tensor copy."""
        import torch

        from skyq.quant.kernels import dispatch

        pairs = dispatch.quantize_int4_packed_group(
            inputs,
            names,
            group_size=self.group_size,
            grid=self.precision_cfg.int4_grid,
            out=None if out is None else [(o[0], o[1]) for o in out],
        )
        shapes = [self._shape_row(t) for t in inputs]
        if out is None:
            return [(packed, scale, rows) for (packed, scale), rows in zip(pairs, shapes)]
        torch._foreach_copy_([o[2] for o in out], shapes)
        return list(out)

    def _shape_row(self, t: Tensor) -> Tensor:
        """`weight_shape` of matrix `t` [N, K], or the [E, 2] rows of stack `t` [E, N, K], on t's
        device: made once per (N, K, members, device), never written."""
        n, k = t.shape[-2:]
        members = t.shape[0] if t.ndim == 3 else 0
        key = (n, k, members, t.device)
        if key not in self._shape_rows:
            from skyq.quant import int4

            rows = int4.weight_shape_tensor(n, k)
            self._shape_rows[key] = (
                rows.expand(members, 2).contiguous().to(t.device) if members else rows.to(t.device)
            )
        return self._shape_rows[key]

    def _decode(self, stem: str, wire: Mapping[str, Tensor], dtype: torch.dtype) -> Tensor:
        from skyq.quant.kernels import dispatch

        # `int4.dequantize_packed`'s bits; one Triton launch for CUDA tensors (the engine's prefill)
        return dispatch.dequantize_int4_packed(
            wire[stem + "weight_packed"], wire[stem + "weight_scale"], wire[stem + "weight_shape"],
            group_size=self.group_size, dtype=dtype, name=stem + "weight",
        )  # fmt: skip

    def fake_quant(self, tensor: Tensor, *, name: str = "weight") -> Tensor:
        from skyq.quant import fake_quant

        return fake_quant.fake_quant_int4(tensor, self.group_size, self.precision_cfg.int4_grid, name=name)

    def quantization_config(self, plan: QuantPlan) -> dict[str, object]:
        """compressed-tensors `pack-quantized` W4A16, symmetric, groups of G (FORMATS.md)."""
        self._check_plan(plan)
        return {
            "quant_method": "compressed-tensors",
            "format": "pack-quantized",
            "quantization_status": "compressed",
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": {
                        "num_bits": 4,
                        "type": "int",
                        "symmetric": True,
                        "strategy": "group",
                        "group_size": self.group_size,
                        "dynamic": False,
                        "observer": "minmax",
                    },
                    "input_activations": None,
                }
            },
            "ignore": plan.ignore_list(),
            "kv_cache_scheme": None,
        }
