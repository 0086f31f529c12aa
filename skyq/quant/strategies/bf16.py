"""bf16: the baseline. Nothing is quantized; every tensor crosses the wire as it is stored."""

from __future__ import annotations

from typing import TYPE_CHECKING

from skyq.config.enums import Precision
from skyq.quant.layouts import Role
from skyq.quant.strategies.base import QuantizationStrategy, register_strategy

if TYPE_CHECKING:
    from torch import Tensor

    from skyq.quant.plan import QuantPlan


@register_strategy
class Bf16Strategy(QuantizationStrategy):
    precision = Precision.bf16
    format_name = None

    @property
    def quantized_roles(self) -> frozenset[Role]:
        return frozenset()

    def fake_quant(self, tensor: Tensor, *, name: str = "weight") -> Tensor:
        return tensor

    def quantization_config(self, plan: QuantPlan) -> None:
        self._check_plan(plan)
        return None
