"""Quantization strategies, one per precision (`get_strategy(precision_cfg)`)."""

from __future__ import annotations

from skyq.config.schema import PrecisionConfig
from skyq.quant.strategies import bf16, fp8_blockwise, int4_qat, mxfp8
from skyq.quant.strategies.base import (
    LINEAR_SCOPE,
    QuantizationStrategy,
    StrategyError,
    WireSpec,
    register_strategy,
    strategy_class,
)


def get_strategy(precision_cfg: PrecisionConfig) -> QuantizationStrategy:
    """The strategy of `precision_cfg.name`, configured by the rest of `precision_cfg`."""
    return strategy_class(precision_cfg.name)(precision_cfg)


__all__ = [
    "LINEAR_SCOPE",
    "QuantizationStrategy",
    "StrategyError",
    "WireSpec",
    "bf16",
    "fp8_blockwise",
    "get_strategy",
    "int4_qat",
    "mxfp8",
    "register_strategy",
    "strategy_class",
]
