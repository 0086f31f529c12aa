"""Straight-through fake quantization for QAT: forward is `dequantize(quantize(w))` of the
reference quantizers, bit for bit, in `w`'s dtype; backward passes the gradient through unchanged.

The forward reuses the exact quantize/dequantize arithmetic of `fp8_blockwise`, `mxfp8` and
`int4`, so what the trainer sees equals what the engine serves after a weight push. Input checks
(finite, shapes) run in the forward; the dequantize-side checks are skipped because the codes and
scales were just produced by the quantizer. On CUDA the FP8 and MXFP8 quantizations go through
`dispatch` (the Triton kernels, bit-identical to the references; FP8 quantizes and dequantizes in
one pass): one launch, and a finite check that a `dispatch.deferred_finite_checks` scope defers
instead of a host sync per call, which is what lets the engine capture its decode step in a CUDA
graph.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from skyq.config.enums import Int4Grid, Precision, ScaleFormat
from skyq.config.schema import PrecisionConfig
from skyq.quant import int4
from skyq.quant.kernels import dispatch


class _FakeQuantFp8Blockwise(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w: Tensor, block_size: tuple[int, int], pow2_scale: bool, name: str) -> Tensor:
        return dispatch.fake_quant_fp8_blockwise(w, block_size=block_size, pow2_scale=pow2_scale, name=name)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, None, None, None


class _FakeQuantMxfp8(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w: Tensor, name: str) -> Tensor:
        return dispatch.fake_quant_mxfp8(w, name=name)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, None


class _FakeQuantInt4(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w: Tensor, group_size: int, grid: Int4Grid | str, name: str) -> Tensor:
        q, scale = int4.quantize(w, group_size=group_size, grid=grid, name=name)
        return int4._dequantize(q, scale, group_size, w.dtype)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, None, None, None


def fake_quant_fp8_blockwise(
    w: Tensor, block_size: tuple[int, int] = (128, 128), pow2_scale: bool = False, *, name: str = "weight"
) -> Tensor:
    """FP8 blockwise fake quant of a weight [..., N, K]; see `fp8_blockwise.quantize`."""
    return _FakeQuantFp8Blockwise.apply(w, tuple(block_size), pow2_scale, name)


def fake_quant_mxfp8(w: Tensor, *, name: str = "weight") -> Tensor:
    """MXFP8 fake quant of a weight [..., N, K] (K % 32 == 0); see `mxfp8.quantize`."""
    return _FakeQuantMxfp8.apply(w, name)


def fake_quant_int4(
    w: Tensor, group_size: int, grid: Int4Grid | str = Int4Grid.kimi, *, name: str = "weight"
) -> Tensor:
    """INT4 W4A16 fake quant of a weight [..., N, K]; see `int4.quantize`."""
    return _FakeQuantInt4.apply(w, group_size, grid, name)


def fake_quant_fp8_activation(
    x: Tensor, tile: int = 128, pow2_scale: bool = False, *, name: str = "activation"
) -> Tensor:
    """FP8 fake quant of activations [..., M, K] in 1 x `tile` tiles along K."""
    return _FakeQuantFp8Blockwise.apply(x, (1, tile), pow2_scale, name)


@dataclass(frozen=True)
class Fp8ActivationQuant:
    """An FP8 recipe's activation quantizer (1 x `tile` blocks along K): called, the fake-quantized
    input (`fake_quant_fp8_activation`); `codes`, the e4m3 codes and scales those values dequantize
    from, bit for bit (what the engine's FP8 x FP8 decode GEMM multiplies)."""

    tile: int
    pow2_scale: bool

    def __call__(self, x: Tensor) -> Tensor:
        return fake_quant_fp8_activation(x, self.tile, self.pow2_scale)

    def codes(self, x: Tensor, *, name: str = "activation") -> tuple[Tensor, Tensor]:
        """(q e4m3 [..., M, K], scale_inv fp32 [..., M, ceil(K/tile)]) of x [..., M, K]."""
        return dispatch.quantize_fp8_activation(x, tile=self.tile, pow2_scale=self.pow2_scale, name=name)


def activation_fake_quant(precision_cfg: PrecisionConfig) -> Callable[[Tensor], Tensor] | None:
    """How a quantized linear's input is quantized, in the trainer and in the engine's W8A8 GEMM
    alike: FP8 blockwise 1 x tile (an `Fp8ActivationQuant`), MXFP8 1 x 32, or not at all (bf16,
    INT4 W4A16)."""
    precision = Precision(precision_cfg.name)
    if precision is Precision.fp8_blockwise:
        pow2 = ScaleFormat(precision_cfg.scale_format) is ScaleFormat.ue8m0
        return Fp8ActivationQuant(precision_cfg.activation_tile, pow2)
    if precision is Precision.mxfp8:
        return fake_quant_mxfp8
    return None
