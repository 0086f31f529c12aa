"""FP8 blockwise linear layers for the native trainer (DeepSeek-V3 / Transformer Engine recipe).

All three GEMMs of a linear run in e4m3 with fp32 accumulation through cuBLAS's blockwise
`scaled_mm` on SM90:

    forward  y  = x  @ W^T    x: 1 x 128 tiles along K,  W: 128 x 128 blocks
    dgrad    dx = dy @ W      dy: 1 x 128 tiles along N, W^T: 128 x 128 blocks
    wgrad    dW = dy^T @ x    dy^T and x^T: 1 x 128 tiles along the token dim M

Each activation is quantized in both orientations by one fused Triton pass
(`triton_fp8_act.quantize_rows_cols`), and the forward saves the fp8 x^T (1 B/element) instead
of x, so the layer also holds half the activation memory. Linears that consume the same tensor
one after another (q/k/v of one attention input, gate/up of one MLP input) share that pass and
the saved x^T (`_LastActivation`). Weights are quantized once per
optimizer step (cached on the parameter's version counter): all microbatches of a step share them.

Elsewhere (CPU, or a GPU without blockwise cuBLAS) the same quantized operands are dequantized
and multiplied in fp32: the exact emulation of the recipe, used by CPU runs and as the oracle the
GPU tests compare cuBLAS against. Token rows are padded to a multiple of 128 (codes 0, scale 1)
because cuBLAS refused some ragged row counts; weight scales are padded to a multiple of 4 blocks
along K because unpadded ones gave silently wrong products (K = 768).

Numerics (tests/gpu/test_fp8_linear.py, H200): y, dx, dW and db match float64 on the quantized
operands within a relative Frobenius error of 1e-2 (bf16 output rounding) at every tested shape,
and float64 on the unquantized inputs within 8e-2 (e4m3 rounds each operand to 2^-4 relative);
at the benchmark shapes the forward differs from bf16 by 3.7e-2.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from skyq.quant import fp8_blockwise
from skyq.quant.kernels.dispatch import uses_kernel

TILE = 128
ALIGN = 16  # cuBLAS FP8: in/out features must be multiples of 16 (16-byte rows of e4m3)


def blockwise_gemm_supported(device: torch.device) -> bool:
    """cuBLAS blockwise FP8 (1x128 / 128x128 scales) exists on SM90 only, with CUDA >= 12.9."""
    if device.type != "cuda" or not hasattr(F, "scaled_mm"):
        return False
    return _sm90_with_blockwise_cublas(torch.device(device).index or torch.cuda.current_device())


@functools.cache
def _sm90_with_blockwise_cublas(index: int) -> bool:
    cuda = tuple(int(v) for v in (torch.version.cuda or "0.0").split(".")[:2])
    return torch.cuda.get_device_capability(index) == (9, 0) and cuda >= (12, 9)


def _round_up(v: int, m: int) -> int:
    return -(-v // m) * m


@dataclass(frozen=True, slots=True)
class WeightOperands:
    """A weight [..., N, K] in both GEMM orientations. `scale_fwd` [..., round4(K/128), N/128] and
    `scale_bwd` [..., round4(N/128), K/128] are cuBLAS's padded 128x128 layouts (strides (1, L4))."""

    q: Tensor
    scale_fwd: Tensor
    qt: Tensor
    scale_bwd: Tensor


def quantize_weight(w: Tensor) -> WeightOperands:
    """128x128-block e4m3 codes and scales of `w`, bit-identical to `fp8_blockwise.quantize(w)`."""
    if uses_kernel(w):
        from skyq.quant.kernels import triton_fp8_act

        return WeightOperands(*triton_fp8_act.quantize_weight(w.detach()))
    q, s = fp8_blockwise.quantize(w.detach(), name="weight")
    nn_, nk = s.shape[-2:]
    s_fwd = F.pad(s, (0, _round_up(nk, 4) - nk), value=1.0).transpose(-1, -2)
    s_bwd = F.pad(s.transpose(-1, -2), (0, _round_up(nn_, 4) - nn_), value=1.0).transpose(-1, -2)
    return WeightOperands(q, s_fwd, q.transpose(-1, -2).contiguous(), s_bwd)


def quantize_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """x [M, K] -> (q [Mp, K], scale [Mp, K/128] with strides (1, Mp)): 1 x 128 tiles along K.
    Mp = M rounded up to 128; the padding rows are codes 0 with scale 1 (cuBLAS refused some
    ragged row counts), and callers keep the first M rows of the product."""
    if uses_kernel(x):
        from skyq.quant.kernels import triton_fp8_act

        return triton_fp8_act.quantize_rows(x)
    q, s = fp8_blockwise.quantize_activation(F.pad(x, (0, 0, 0, _round_up(x.shape[0], TILE) - x.shape[0])))
    return q, s.t().contiguous().t()


def quantize_rows_cols(x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """x [M, K] -> rows as `quantize_rows`, plus (x^T codes [K, Mp], scale [K, Mp/128] with
    strides (1, K)): 1 x 128 tiles along M, cuBLAS's wgrad contraction tiles."""
    if uses_kernel(x):
        from skyq.quant.kernels import triton_fp8_act

        return triton_fp8_act.quantize_rows_cols(x)
    q, s = quantize_rows(x)
    qt, st = fp8_blockwise.quantize_activation(F.pad(x, (0, 0, 0, q.shape[0] - x.shape[0])).t())
    return q, s, qt, st.t().contiguous().t()


class _LastActivation(threading.local):
    """The quantization of the last activation a linear consumed, kept for the next linear that
    consumes the same tensor (q/k/v read one normed input, gate/up another): one pass instead of
    one per consumer, and one saved x^T for all their wgrads. "Same" is identity (a weak reference,
    so the entry dies with the tensor) and an unchanged autograd version counter (an in-place
    write invalidates it). One entry per thread."""

    def __init__(self) -> None:
        self._ref: weakref.ref | None = None
        self._version = -1
        self._ops: tuple[Tensor, ...] = ()

    def get(self, x: Tensor, cols: bool) -> tuple[Tensor, ...] | None:
        """(q, scale) for `cols` False, (q, scale, q^T, scale^T) for True; None on a miss."""
        if self._ref is None or self._ref() is not x or x._version != self._version:
            return None
        if cols and len(self._ops) < 4:
            return None
        return self._ops if cols else self._ops[:2]

    def put(self, x: Tensor, ops: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        self._ref = weakref.ref(x, self._forget)
        self._version = x._version
        self._ops = ops
        return ops

    def _forget(self, _ref: weakref.ref) -> None:
        if self._ref is _ref:
            self._ref, self._ops = None, ()


_last_activation = _LastActivation()


def forget_last_activation() -> None:
    """Drop the shared activation quantization (`_LastActivation`): for a benchmark that feeds one
    tensor to the linear again and again, which must pay the quantization every call."""
    _last_activation.__init__()


def _quantized_input(x: Tensor, x2: Tensor, cols: bool) -> tuple[Tensor, ...]:
    """`quantize_rows_cols(x2)` (`cols`) or `quantize_rows(x2)` of the 2-D view `x2` of `x`,
    shared with the previous linear that consumed `x` (`_LastActivation`)."""
    if x.is_inference():  # no version counter to tell an in-place write: not shared
        return quantize_rows_cols(x2) if cols else quantize_rows(x2)
    hit = _last_activation.get(x, cols)
    if hit is not None:
        return hit
    return _last_activation.put(x, quantize_rows_cols(x2) if cols else quantize_rows(x2))


def _expand(scale: Tensor, rows: int, cols: int, block_rows: int, block_cols: int) -> Tensor:
    return scale.repeat_interleave(block_rows, 0)[:rows].repeat_interleave(block_cols, 1)[:, :cols]


def blockwise_gemm(
    a: Tensor,
    scale_a: Tensor,
    b: Tensor,
    scale_b: Tensor,
    *,
    b_blocks: bool,
    out_dtype: torch.dtype,
    emulate: bool,
) -> Tensor:
    """a [M, C] e4m3 with 1x128 scales [M, C/128]; b [C, N] e4m3 (column-major) with either
    128x128 scales [round4(C/128), N/128] (`b_blocks`) or 1x128 scales [N, C/128]."""
    if not emulate:
        from torch.nn.functional import ScalingType

        recipe_b = ScalingType.BlockWise128x128 if b_blocks else ScalingType.BlockWise1x128
        return F.scaled_mm(
            a, b, scale_a, ScalingType.BlockWise1x128, scale_b, recipe_b, output_dtype=out_dtype
        )
    m, c = a.shape
    n = b.shape[1]
    a32 = a.float() * _expand(scale_a, m, c, 1, TILE)
    sb = _expand(scale_b, c, n, TILE, TILE) if b_blocks else _expand(scale_b.t(), c, n, TILE, 1)
    return (a32 @ (b.float() * sb)).to(out_dtype)


class _LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, x: Tensor, weight: Tensor, bias: Tensor | None, ops: WeightOperands, emulate: bool
    ) -> Tensor:
        n, k = weight.shape
        x2 = x.reshape(-1, k)
        if ctx.needs_input_grad[1]:
            xq, xs, xtq, xts = _quantized_input(x, x2, cols=True)
            ctx.save_for_backward(xtq, xts)
        else:
            xq, xs = _quantized_input(x, x2, cols=False)
        out = blockwise_gemm(
            xq, xs, ops.q.t(), ops.scale_fwd, b_blocks=True, out_dtype=x.dtype, emulate=emulate
        )[: x2.shape[0]]
        if bias is not None:
            out = out + bias
        ctx.ops, ctx.emulate, ctx.x_shape, ctx.x_dtype, ctx.w_dtype = (
            ops,
            emulate,
            x.shape,
            x.dtype,
            weight.dtype,
        )
        return out.reshape(*x.shape[:-1], n)

    @staticmethod
    def backward(ctx, dy: Tensor):
        need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
        ops: WeightOperands = ctx.ops
        dy2 = dy.reshape(-1, dy.shape[-1])
        dx = dw = db = None
        if need_dw:
            dyq, dys, dytq, dyts = quantize_rows_cols(dy2)
            xtq, xts = ctx.saved_tensors
            dw = blockwise_gemm(
                dytq, dyts, xtq.t(), xts, b_blocks=False, out_dtype=ctx.w_dtype, emulate=ctx.emulate
            )
        elif need_dx:
            dyq, dys = quantize_rows(dy2)
        if need_dx:
            dx = blockwise_gemm(
                dyq, dys, ops.qt.t(), ops.scale_bwd, b_blocks=True, out_dtype=ctx.x_dtype, emulate=ctx.emulate
            )
            dx = dx[: dy2.shape[0]].reshape(ctx.x_shape)
        if need_db:
            db = dy2.sum(0)
        return dx, dw, db, None, None


def _check_features(n: int, k: int) -> None:
    if n % ALIGN or k % ALIGN:
        raise ValueError(
            f"FP8 blockwise linear needs in_features and out_features divisible by {ALIGN} (cuBLAS FP8 "
            f"rows are 16-byte aligned); got out={n} (= {n // ALIGN} * {ALIGN} + {n % ALIGN}), "
            f"in={k} (= {k // ALIGN} * {ALIGN} + {k % ALIGN}); keep this layer in bf16"
        )


def _emulate(device: torch.device, emulate: bool | None) -> bool:
    return not blockwise_gemm_supported(device) if emulate is None else emulate


def fp8_blockwise_linear(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    *,
    weight_operands: WeightOperands | None = None,
    emulate: bool | None = None,
) -> Tensor:
    """`F.linear(x, weight, bias)` with all three GEMMs in FP8 blockwise.

    `weight_operands` reuses a quantized weight (e.g. across microbatches); it must come from
    `quantize_weight(weight)`. `emulate` forces the fp32 emulation (True) or cuBLAS (False);
    None picks cuBLAS wherever `blockwise_gemm_supported`.
    """
    _check_features(*weight.shape)
    ops = weight_operands if weight_operands is not None else quantize_weight(weight)
    return _LinearFn.apply(x, weight, bias, ops, _emulate(x.device, emulate))


class WeightCache:
    """The quantized operands of one weight, recomputed only when the weight changes: keyed on
    the storage pointer and the autograd version counter, which every in-place update (an
    optimizer step, `load_state_dict`) bumps."""

    def __init__(self) -> None:
        self._key: tuple[int, int] | None = None
        self._ops: WeightOperands | None = None

    def get(self, weight: Tensor) -> WeightOperands:
        key = (weight.data_ptr(), weight._version)
        if self._ops is None or key != self._key:
            self._ops, self._key = quantize_weight(weight), key
        return self._ops


class FP8BlockwiseLinear(nn.Linear):
    """Drop-in `nn.Linear` (same parameters and state-dict names) computing in FP8 blockwise."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None
    ) -> None:
        _check_features(out_features, in_features)
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self._cache = WeightCache()

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> FP8BlockwiseLinear:
        """Wrap `linear`'s own parameters (no copy), for the trainer's module swap."""
        _check_features(linear.out_features, linear.in_features)
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.weight, new.bias = linear.weight, linear.bias
        new._cache = WeightCache()
        return new

    def forward(self, x: Tensor) -> Tensor:
        return fp8_blockwise_linear(x, self.weight, self.bias, weight_operands=self._cache.get(self.weight))


class _ExpertsFn(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, x: Tensor, weight: Tensor, counts: tuple[int, ...], ops: WeightOperands, emulate: bool
    ) -> Tensor:
        outs, saved = [], []
        start = 0
        for e, count in enumerate(counts):
            xe = x[start : start + count]
            start += count
            if count == 0:
                saved.append(None)
                continue
            if ctx.needs_input_grad[1]:
                xq, xs, xtq, xts = quantize_rows_cols(xe)
                saved.append((xtq, xts))
            else:
                xq, xs = quantize_rows(xe)
            outs.append(
                blockwise_gemm(
                    xq, xs, ops.q[e].t(), ops.scale_fwd[e], b_blocks=True, out_dtype=x.dtype, emulate=emulate
                )[:count]
            )
        ctx.ops, ctx.emulate, ctx.counts, ctx.saved, ctx.w_dtype = ops, emulate, counts, saved, weight.dtype
        n = weight.shape[1]
        return torch.cat(outs) if outs else x.new_zeros((0, n))

    @staticmethod
    def backward(ctx, dy: Tensor):
        need_dx, need_dw = ctx.needs_input_grad[:2]
        ops: WeightOperands = ctx.ops
        e_total, n, k = ops.q.shape
        dxs = []
        dw = torch.empty((e_total, n, k), dtype=ctx.w_dtype, device=dy.device) if need_dw else None
        start = 0
        for e, count in enumerate(ctx.counts):
            dye = dy[start : start + count]
            start += count
            if count == 0:
                if need_dw:
                    dw[e].zero_()
                continue
            if need_dw:
                dyq, dys, dytq, dyts = quantize_rows_cols(dye)
                xtq, xts = ctx.saved[e]
                dw[e] = blockwise_gemm(
                    dytq, dyts, xtq.t(), xts, b_blocks=False, out_dtype=ctx.w_dtype, emulate=ctx.emulate
                )
            else:
                dyq, dys = quantize_rows(dye)
            if need_dx:
                dxs.append(
                    blockwise_gemm(
                        dyq,
                        dys,
                        ops.qt[e].t(),
                        ops.scale_bwd[e],
                        b_blocks=True,
                        out_dtype=dy.dtype,
                        emulate=ctx.emulate,
                    )[:count]
                )
        dx = (torch.cat(dxs) if dxs else dy.new_zeros((0, k))) if need_dx else None
        ctx.saved = None
        return dx, dw, None, None, None


def fp8_expert_linear(
    x: Tensor,
    weight: Tensor,
    counts: Sequence[int],
    *,
    weight_operands: WeightOperands | None = None,
    emulate: bool | None = None,
) -> Tensor:
    """Routed-expert GEMMs: x [T, K] holds each expert's tokens contiguously, in expert order,
    `counts[e]` of them; weight [E, N, K]. Returns [T, N] with rows `x_e @ weight[e]^T`.

    The weight stack is quantized in one launch; each expert's tokens get one fused activation
    pass and one cuBLAS GEMM per direction (a loop over experts, skipping empty ones)."""
    if weight.ndim != 3 or x.ndim != 2 or len(counts) != weight.shape[0] or sum(counts) != x.shape[0]:
        raise ValueError(
            f"fp8_expert_linear: need x [T, K], weight [E, N, K], len(counts) == E and sum(counts) == T; "
            f"got x {tuple(x.shape)}, weight {tuple(weight.shape)}, {len(counts)} counts summing to {sum(counts)}"
        )
    _check_features(*weight.shape[1:])
    ops = weight_operands if weight_operands is not None else quantize_weight(weight)
    return _ExpertsFn.apply(x, weight, tuple(int(c) for c in counts), ops, _emulate(x.device, emulate))
