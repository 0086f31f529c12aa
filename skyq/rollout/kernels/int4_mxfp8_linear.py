"""The engine's weight-only decode linears for formats with per-row group scales: symmetric INT4
`pack-quantized` (`int4_weight_only_linear`, grouped over MoE experts `int4_grouped_weight_only_linear`)
and MXFP8 (`mxfp8_weight_only_linear`, `mxfp8_grouped_weight_only_linear`), each with its torch
reference and the check of what its kernel takes."""

from __future__ import annotations

import torch
from torch import Tensor

from skyq.quant import errors, int4, mxfp8
from skyq.quant.errors import QuantizationError
from skyq.quant.kernels import dispatch
from skyq.rollout.kernels._experts import check_offsets, each_expert

# --- INT4 weight-only linear (the engine's decode) -----------------------------------------------


def _check_int4_linear_args(x: Tensor, packed: Tensor, scale: Tensor, group_size: int, what: str) -> None:
    """x [..., K] floating; packed int32 [..., N, K/8]; scale floating [..., N, K/G] (G =
    group_size, dividing K)."""
    if not (isinstance(x, Tensor) and x.is_floating_point() and x.ndim >= 1):
        raise QuantizationError(f"{what}: x must be a floating-point tensor [..., K], got {type(x).__name__}")
    errors.check_dtype(packed, torch.int32, f"{what} weight_packed")
    k = x.shape[-1]
    if packed.ndim < 2 or k % int4.CODES_PER_WORD or packed.shape[-1] != k // int4.CODES_PER_WORD:
        raise QuantizationError(
            f"{what}: x {tuple(x.shape)} and weight_packed {tuple(packed.shape)} do not match "
            f"([..., K] @ [N, K/8]^T with K a multiple of {int4.CODES_PER_WORD})"
        )
    if not (isinstance(group_size, int) and group_size > 0 and k % group_size == 0):
        raise QuantizationError(f"{what}: group_size {group_size!r} must be a positive divisor of K = {k}")
    if not (isinstance(scale, Tensor) and scale.is_floating_point()):
        raise QuantizationError(
            f"{what} weight_scale: expected a floating-point tensor, got {type(scale).__name__}"
        )
    errors.check_shape(
        scale, (*packed.shape[:-1], k // group_size), f"{what} weight_scale", f"N, {k} / {group_size} groups"
    )


def int4_weight_only_linear_reference(x: Tensor, packed: Tensor, scale: Tensor, group_size: int) -> Tensor:
    """`x.float() @ int4.dequantize_packed(...).float().T` in x's dtype: the weight the trainer and the
    engine's prefill use (codes times scales in the scale's dtype), fp32 products and sums."""
    n, k = packed.shape[-2], packed.shape[-1] * int4.CODES_PER_WORD
    w = int4.dequantize_packed(packed, scale, (n, k), group_size=group_size, name="int4 linear weight")
    return (x.float() @ w.float().T).to(x.dtype)


def int4_kernel_takes(x: Tensor, packed: Tensor, scale: Tensor, group_size: int, *others: Tensor) -> bool:
    """The INT4 decode kernel takes these (shapes checked apart): bf16 x and bf16 scales on a CUDA
    device (with Triton), the words and the scales of unit stride along K, groups of whole words (x
    of another stride is made contiguous first)."""
    if not (dispatch.uses_kernel(x) and x.dtype == torch.bfloat16 and scale.dtype == torch.bfloat16):
        return False
    from skyq.rollout.kernels import triton_int4_gemv as kernels

    return (
        all(t.is_cuda and t.device == x.device for t in (packed, scale, *others))
        and packed.stride(-1) == 1 and scale.stride(-1) == 1
        and kernels.supports(group_size, packed.shape[-1] * int4.CODES_PER_WORD)
    )  # fmt: skip


def int4_weight_only_linear(x: Tensor, packed: Tensor, scale: Tensor, group_size: int) -> Tensor:
    """Decode linear `x [..., K] @ dequant(packed int32 [N, K/8], scale [N, K/G])^T -> [..., N]` in x's
    dtype for symmetric `pack-quantized` INT4. On CUDA (bf16 x and scales) one kernel dequantizes in
    registers (`triton_int4_gemv.linear`: no dequantized weight in memory, no host sync) up to
    `triton_int4_gemv.KERNEL_MAX_ROWS` rows, or more while rows x N x K is small (`dequantizes_first`);
    else the weight is dequantized once (the same register dequantization,
    `triton_int4_dequant.dequantize`) for bf16's GEMM, also without a host sync; elsewhere the
    reference (the same bf16 weight, fp32 sums)."""
    _check_int4_linear_args(x, packed, scale, group_size, "int4 linear")
    if packed.ndim != 2:
        raise QuantizationError(f"int4 linear: weight_packed must be [N, K/8], got {tuple(packed.shape)}")
    if x.numel() and int4_kernel_takes(x, packed, scale, group_size):
        from skyq.quant.kernels import triton_int4_dequant
        from skyq.rollout.kernels import triton_int4_gemv as kernels

        x2 = x.reshape(-1, x.shape[-1])
        n, k = packed.shape[0], packed.shape[1] * int4.CODES_PER_WORD
        if kernels.dequantizes_first(x2.shape[0], n, k):  # the weight dequantized once, then bf16's GEMM
            w = triton_int4_dequant.dequantize(
                packed.contiguous()[None], scale.contiguous()[None], n, k, group_size
            )
            return torch.nn.functional.linear(x, w[0])
        x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
        return kernels.linear(x2, packed, scale, group_size=group_size).reshape(
            *x.shape[:-1], packed.shape[0]
        )
    return int4_weight_only_linear_reference(x, packed, scale, group_size)


def int4_grouped_weight_only_linear(
    x: Tensor, packed: Tensor, scale: Tensor, offsets: Tensor, group_size: int
) -> Tensor:
    """MoE experts' INT4 decode linears in one call: x [T, K] with its rows sorted by expert (expert
    e's rows offsets[e]:offsets[e + 1], offsets int32 [E + 1], offsets[E] == T), packed int32 [E, N,
    K/8], scale [E, N, K/G] -> [T, N] in x's dtype. On CUDA one launch (`triton_int4_gemv.
    linear_grouped`: no host sync, an expert without rows reads nothing), which trusts the offsets'
    values (shapes and dtypes are checked); elsewhere `int4_weight_only_linear` on each expert's rows,
    after checking that the offsets rise from 0 to T."""
    if not (isinstance(packed, Tensor) and packed.ndim == 3):
        raise QuantizationError(
            f"int4 grouped linear: weight_packed must be [E, N, K/8], got {getattr(packed, 'shape', packed)!r}"
        )
    _check_int4_linear_args(x, packed, scale, group_size, "int4 grouped linear")
    check_offsets(offsets, packed.shape[0], "int4 grouped linear")
    if x.ndim != 2:
        raise QuantizationError(f"int4 grouped linear: x must be [T, K], got {tuple(x.shape)}")
    if x.numel() and int4_kernel_takes(x, packed, scale, group_size, offsets):
        from skyq.rollout.kernels import triton_int4_gemv as kernels

        x = x if x.stride(-1) == 1 else x.contiguous()
        return kernels.linear_grouped(x, packed, scale, offsets, group_size=group_size)
    return each_expert(
        x, offsets, packed.shape[1], "int4 grouped linear",
        lambda e, rows: int4_weight_only_linear(rows, packed[e], scale[e], group_size),
    )  # fmt: skip


# --- MXFP8 weight-only linear (decode) ---------------------------------------------------------


def mxfp8_weight_only_linear_reference(x: Tensor, q: Tensor, scale_u8: Tensor) -> Tensor:
    """`x.float() @ mxfp8.dequantize(q, scale_u8).float().T` in x's dtype: the bf16 weight the
    trainer and the engine's prefill use, fp32 products and sums."""
    w = mxfp8.dequantize(q, scale_u8, dtype=torch.bfloat16, name="mxfp8 linear weight")
    return (x.float() @ w.float().transpose(-1, -2)).to(x.dtype)


def _check_mxfp8_linear_args(x: Tensor, q: Tensor, scale_u8: Tensor, what: str) -> None:
    if not (isinstance(x, Tensor) and x.is_floating_point()):
        raise QuantizationError(f"{what}: x must be a floating tensor, got {getattr(x, 'dtype', x)!r}")
    if not (isinstance(q, Tensor) and q.dtype == torch.float8_e4m3fn and q.ndim >= 2):
        raise QuantizationError(
            f"{what}: weight must be float8_e4m3fn [..., N, K], got {getattr(q, 'dtype', q)!r}"
        )
    if x.shape[-1] != q.shape[-1]:
        raise QuantizationError(f"{what}: x has K={x.shape[-1]} but the weight has K={q.shape[-1]}")
    expected = (*q.shape[:-1], -(-q.shape[-1] // mxfp8.BLOCK))
    if not (
        isinstance(scale_u8, Tensor) and scale_u8.dtype == torch.uint8 and tuple(scale_u8.shape) == expected
    ):
        raise QuantizationError(
            f"{what}: weight_scale must be uint8 {expected} (one E8M0 byte a row and {mxfp8.BLOCK} columns), "
            f"got {getattr(scale_u8, 'dtype', scale_u8)!r} {tuple(getattr(scale_u8, 'shape', ()))}"
        )


def mxfp8_kernel_takes(x: Tensor, q: Tensor, scale_u8: Tensor, *others: Tensor) -> bool:
    """The MXFP8 decode kernel (`gluon_wo_gemv.linear_mxfp8`) takes these (shapes checked apart):
    bf16 x on a CUDA device with the e4m3 conversion (compute capability >= 8.9) and Triton's Gluon,
    the codes read as int32 words (`gluon_wo_gemv.supports_mxfp8`: K a multiple of 32), the scales of
    unit stride along K."""
    if not (dispatch.uses_kernel(x) and x.dtype == torch.bfloat16 and q.dtype == torch.float8_e4m3fn):
        return False
    from skyq.rollout.kernels import triton_fp8_gemv, triton_int4_gemv

    kernels = triton_int4_gemv.gluon_wo
    return (
        kernels is not None and scale_u8.dtype == torch.uint8
        and all(t.is_cuda and t.device == x.device for t in (q, scale_u8, *others))
        and triton_fp8_gemv._has_e4m3_cvt(x.device.index or 0)
        and kernels.supports_mxfp8(q) and scale_u8.stride(-1) == 1
    )  # fmt: skip


def mxfp8_weight_only_linear(x: Tensor, q: Tensor, scale_u8: Tensor) -> Tensor:
    """Decode linear `x [..., K] @ mxfp8_dequant(q e4m3 [N, K], scale uint8 [N, K/32])^T -> [..., N]` in
    x's dtype. On CUDA one kernel reads the codes and scales and dequantizes in registers (no
    dequantized weight, no host sync: the weight was checked when it was loaded) up to
    `triton_int4_gemv.KERNEL_MAX_ROWS` rows, or more while rows x N x K is small (INT4's rule,
    `dequantizes_first`: the same Gluon kernel body, whose row tiles each dequantize the whole
    weight again); else the weight is dequantized once (`dispatch.dequantize_mxfp8`, its finite
    check deferred inside the engine's steps) for bf16's GEMM: the prefill's bits; elsewhere the
    reference (the same bf16 weight, fp32 sums)."""
    _check_mxfp8_linear_args(x, q, scale_u8, "mxfp8 linear")
    if q.ndim != 2:
        raise QuantizationError(f"mxfp8 linear: weight must be [N, K], got {tuple(q.shape)}")
    if x.numel() and mxfp8_kernel_takes(x, q, scale_u8):
        from skyq.rollout.kernels import triton_fp8_gemv, triton_int4_gemv

        x2 = x.reshape(-1, x.shape[-1])
        if triton_int4_gemv.dequantizes_first(x2.shape[0], *q.shape):  # dequantized once, then bf16's GEMM
            w = dispatch.dequantize_mxfp8(q, scale_u8, dtype=x.dtype, name="mxfp8 linear weight")
            return torch.nn.functional.linear(x, w)
        y = triton_int4_gemv.gluon_wo.linear_mxfp8(
            x2,
            q,
            scale_u8,
            sms=triton_fp8_gemv.sm_count(x.device),
            counters=triton_fp8_gemv._arrival_counters,
        )
        return y.reshape(*x.shape[:-1], q.shape[0])
    return mxfp8_weight_only_linear_reference(x, q, scale_u8)


def mxfp8_grouped_weight_only_linear(x: Tensor, q: Tensor, scale_u8: Tensor, offsets: Tensor) -> Tensor:
    """MoE experts' MXFP8 decode linears in one call: x [T, K] with its rows sorted by expert
    (offsets int32 [E + 1], as `int4_grouped_weight_only_linear` takes them), q e4m3 [E, N, K],
    scale uint8 [E, N, K/32] -> [T, N] in x's dtype. On CUDA one launch (no host sync, an expert
    without rows reads nothing; the offsets' values trusted); elsewhere each expert's rows through
    `mxfp8_weight_only_linear`, after checking the offsets."""
    _check_mxfp8_linear_args(x, q, scale_u8, "mxfp8 grouped linear")
    if q.ndim != 3:
        raise QuantizationError(f"mxfp8 grouped linear: weight must be [E, N, K], got {tuple(q.shape)}")
    check_offsets(offsets, q.shape[0], "mxfp8 grouped linear")
    if x.ndim != 2:
        raise QuantizationError(f"mxfp8 grouped linear: x must be [T, K], got {tuple(x.shape)}")
    if x.numel() and mxfp8_kernel_takes(x, q, scale_u8, offsets):
        from skyq.rollout.kernels import triton_fp8_gemv, triton_int4_gemv

        return triton_int4_gemv.gluon_wo.linear_grouped_mxfp8(
            x, q, scale_u8, offsets, sms=triton_fp8_gemv.sm_count(x.device)
        )
    return each_expert(
        x, offsets, q.shape[1], "mxfp8 grouped linear",
        lambda e, rows: mxfp8_weight_only_linear(rows, q[e], scale_u8[e]),
    )  # fmt: skip
