"""The engine's FP8 blockwise decode linears: weight-only (bf16 activations times e4m3 weight codes,
dequantized in registers) and W8A8 (e4m3 activation codes times e4m3 weight codes on the FP8 tensor
cores), dense and grouped over MoE experts. Each runs its Triton/Gluon kernel on CUDA and its torch
reference elsewhere, with the same argument checks on both paths; the references compute from the
bf16 weight the trainer and the engine's prefill use."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
from torch import Tensor

from skyq.quant import errors, fp8_blockwise
from skyq.quant.errors import QuantizationError
from skyq.quant.kernels import dispatch
from skyq.rollout.kernels._experts import check_offsets, each_expert, offset_bounds

# --- FP8 weight-only linear (decode) -------------------------------------------------------------


def fp8_weight_only_linear_reference(
    x: Tensor, q: Tensor, scale_inv: Tensor, *, block_size: tuple[int, int] = (128, 128)
) -> Tensor:
    """`x.float() @ fp8_blockwise.dequantize(q, scale_inv, bfloat16).float().T`, cast to x's dtype:
    the weight the trainer and the engine's prefill use, bf16(fp32(q) * s), as the kernel does."""
    w = fp8_blockwise.dequantize(
        q, scale_inv, block_size=block_size, dtype=torch.bfloat16, name="fp8 linear weight"
    )
    return (x.float() @ w.float().T).to(x.dtype)


def _check_linear_args(x: Tensor, q: Tensor, scale_inv: Tensor, block_size: Sequence[int]) -> None:
    if not (isinstance(x, Tensor) and x.is_floating_point() and x.ndim >= 1):
        raise QuantizationError(
            f"fp8 linear: x must be a floating-point tensor [..., K], got {type(x).__name__}"
        )
    errors.check_dtype(q, torch.float8_e4m3fn, "fp8 linear weight")
    errors.check_dtype(scale_inv, torch.float32, "fp8 linear weight_scale_inv")
    if q.ndim != 2 or x.shape[-1] != q.shape[1]:
        raise QuantizationError(
            f"fp8 linear: x {tuple(x.shape)} and weight {tuple(q.shape)} do not match ([..., K] @ [N, K]^T)"
        )
    if not (len(block_size) == 2 and all(isinstance(b, int) and b > 0 for b in block_size)):
        raise QuantizationError(f"fp8 linear: block_size must be two positive ints, got {block_size!r}")
    (n, k), (bn, bk) = q.shape, block_size
    errors.check_shape(
        scale_inv, (-(-n // bn), -(-k // bk)), "fp8 linear weight_scale_inv", "ceil(N/bn), ceil(K/bk)"
    )


def fp8_weight_only_linear(
    x: Tensor, q: Tensor, scale_inv: Tensor, block_size: tuple[int, int] = (128, 128)
) -> Tensor:
    """Decode linear `x [..., K] @ dequant(q e4m3 [N, K], weight_scale_inv fp32)^T -> [..., N]` in
    x's dtype. On CUDA a kernel dequantizes in registers (no dequantized weight in memory, no host
    sync; meant for M <= 64 rows, correct for any M): the Gluon one at <= 16 rows on sm_89+, the
    Triton one otherwise (`triton_fp8_gemv.linear`); elsewhere the reference (the same bf16
    weight, fp32 products and sums)."""
    _check_linear_args(x, q, scale_inv, block_size)
    if dispatch.uses_kernel(x) and q.is_cuda and scale_inv.is_cuda and x.dtype == torch.bfloat16:
        from skyq.rollout.kernels import triton_fp8_gemv as kernels

        if kernels.supports(tuple(block_size)) and x.numel():
            return kernels.linear(x, q, scale_inv, block_size=tuple(block_size))
    return fp8_weight_only_linear_reference(x, q, scale_inv, block_size=tuple(block_size))


def fp8_grouped_weight_only_linear(
    x: Tensor, q: Tensor, scale_inv: Tensor, offsets: Tensor, block_size: tuple[int, int] = (128, 128)
) -> Tensor:
    """MoE experts' decode linears in one call: x [T, K] with its rows sorted by expert (expert e's
    rows offsets[e]:offsets[e + 1], offsets int32 [E + 1], offsets[E] == T), q e4m3 [E, N, K],
    weight_scale_inv fp32 [E, ceil(N/bn), ceil(K/bk)] -> [T, N] in x's dtype. On CUDA one launch of
    the grouped Gluon kernel (no host sync; an expert without rows reads nothing), which therefore
    trusts the offsets' values (shapes and dtypes are checked): build them on the device from the
    sorted routing, as `WireExperts` does. Elsewhere (and on GPUs the kernel does not take)
    `fp8_weight_only_linear` on each expert's rows, after checking that the offsets rise from 0 to T."""
    if not (isinstance(q, Tensor) and q.ndim == 3):
        raise QuantizationError(
            f"fp8 grouped linear: weight must be [E, N, K], got {getattr(q, 'shape', q)!r}"
        )
    n_experts = q.shape[0]
    check_offsets(offsets, n_experts, "fp8 grouped linear")
    errors.check_shape(
        scale_inv, (n_experts, -(-q.shape[1] // block_size[0]), -(-q.shape[2] // block_size[1])),
        "fp8 grouped linear weight_scale_inv", "E, ceil(N/bn), ceil(K/bk)",
    )  # fmt: skip
    _check_linear_args(x, q[0], scale_inv[0], block_size)
    if x.ndim != 2:
        raise QuantizationError(f"fp8 grouped linear: x must be [T, K], got {tuple(x.shape)}")
    if (
        dispatch.uses_kernel(x)
        and q.is_cuda
        and scale_inv.is_cuda
        and offsets.is_cuda
        and x.dtype == torch.bfloat16
    ):
        from skyq.rollout.kernels import triton_fp8_gemv as kernels

        if kernels.grouped_applies(x, q, tuple(block_size)):
            return kernels.linear_grouped(x, q, scale_inv, offsets, block_size=tuple(block_size))
    return each_expert(
        x, offsets, q.shape[1], "fp8 grouped linear",
        lambda e, rows: fp8_weight_only_linear(rows, q[e], scale_inv[e], block_size),
    )  # fmt: skip


# --- FP8 x FP8 linear (the engine's large decode steps) ------------------------------------------

W8A8_BLOCK = (128, 128)
"""The weight blocks the FP8 x FP8 linear takes (and its activations' 1 x 128 tiles)."""


def _check_w8a8_args(xq: Tensor, xs: Tensor, q: Tensor, s: Tensor, what: str) -> None:
    """xq e4m3 [M, K] with scales xs fp32 [M, ceil(K/128)]; q e4m3 [..., N, K] with s fp32 [...,
    ceil(N/128), ceil(K/128)]."""
    errors.check_dtype(xq, torch.float8_e4m3fn, f"{what} activation codes")
    errors.check_dtype(xs, torch.float32, f"{what} activation scales")
    errors.check_dtype(q, torch.float8_e4m3fn, f"{what} weight")
    errors.check_dtype(s, torch.float32, f"{what} weight_scale_inv")
    if xq.ndim != 2 or q.ndim < 2 or xq.shape[1] != q.shape[-1]:
        raise QuantizationError(
            f"{what}: activation codes {tuple(xq.shape)} and weight {tuple(q.shape)} do not match ([M, K] @ [N, K]^T)"
        )
    bn, bk = W8A8_BLOCK
    n, k = q.shape[-2:]
    errors.check_shape(xs, (xq.shape[0], -(-k // bk)), f"{what} activation scales", "M, ceil(K/128)")
    errors.check_shape(
        s,
        (*q.shape[:-2], -(-n // bn), -(-k // bk)),
        f"{what} weight_scale_inv",
        "..., ceil(N/128), ceil(K/128)",
    )


def w8a8_kernel_available(device: torch.device) -> bool:
    """The FP8 x FP8 kernel runs on `device`: a CUDA device with e4m3 tensor cores (compute
    capability >= 8.9) and Triton present."""
    device = torch.device(device)
    return device.type == "cuda" and dispatch.triton_available() and _capability(device.index or 0) >= (8, 9)


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _w8a8_kernel_takes(xq: Tensor, q: Tensor, *others: Tensor) -> bool:
    """The Triton kernel takes this call: every tensor on one CUDA device with e4m3 tensor cores
    (compute capability >= 8.9), codes of unit stride along K."""
    return (
        dispatch.uses_kernel(xq)
        and all(t.device == xq.device for t in (q, *others))
        and w8a8_kernel_available(xq.device)
        and xq.stride(-1) == 1
        and q.stride(-1) == 1
        and xq.numel() > 0
    )


def fp8_w8a8_linear_reference(
    xq: Tensor, xs: Tensor, q: Tensor, s: Tensor, *, out_dtype: torch.dtype = torch.bfloat16
) -> Tensor:
    """`dequantize(xq, xs) @ dequantize(q, s)^T` in fp32 (1 x 128 activation tiles, 128 x 128
    weight blocks), cast to `out_dtype`: the kernel's value up to its fp32 summation order."""
    x = fp8_blockwise.dequantize_activation(xq, xs, tile=W8A8_BLOCK[1], dtype=torch.float32)
    w = fp8_blockwise.dequantize(q, s, block_size=W8A8_BLOCK, dtype=torch.float32, name="fp8 w8a8 weight")
    return (x @ w.T).to(out_dtype)


def fp8_w8a8_linear(
    xq: Tensor, xs: Tensor, q: Tensor, s: Tensor, *, out_dtype: torch.dtype = torch.bfloat16
) -> Tensor:
    """Decode linear on FP8 codes on both sides: activation codes xq e4m3 [M, K] with 1 x 128 tile
    scales xs fp32 [M, ceil(K/128)] (`quantize_fp8_activation`) times the weight q e4m3 [N, K] with
    128 x 128 block scales s -> [M, N] in `out_dtype`. On CUDA (sm_89+) one launch of
    `triton_fp8_w8a8.linear` on the FP8 tensor cores, no host sync; elsewhere the reference."""
    _check_w8a8_args(xq, xs, q, s, "fp8 w8a8 linear")
    if q.ndim != 2:
        raise QuantizationError(f"fp8 w8a8 linear: weight must be [N, K], got {tuple(q.shape)}")
    if _w8a8_kernel_takes(xq, q, xs, s):
        from skyq.rollout.kernels import triton_fp8_w8a8 as kernels

        return kernels.linear(xq, xs, q, s, out_dtype=out_dtype)
    return fp8_w8a8_linear_reference(xq, xs, q, s, out_dtype=out_dtype)


def fp8_grouped_w8a8_linear(
    xq: Tensor,
    xs: Tensor,
    q: Tensor,
    s: Tensor,
    offsets: Tensor,
    *,
    index: Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> Tensor:
    """MoE experts' decode linears on FP8 codes in one call: routed row m (sorted by expert, expert
    e's rows offsets[e]:offsets[e + 1], offsets int32 [E + 1]) multiplies activation row index[m]
    (m without `index`) of xq e4m3 [*, K] / xs fp32 [*, ceil(K/128)] by expert e's q e4m3 [E, N, K]
    / s fp32 [E, ceil(N/128), ceil(K/128)] -> [T, N] in `out_dtype`. On CUDA one launch (no host
    sync), which trusts the offsets' and the index's values (build them on the device from the
    routing, as `WireExperts` does); elsewhere the reference per expert, after checking them."""
    _check_w8a8_args(xq, xs, q, s, "fp8 grouped w8a8 linear")
    if q.ndim != 3:
        raise QuantizationError(f"fp8 grouped w8a8 linear: weight must be [E, N, K], got {tuple(q.shape)}")
    n_experts = q.shape[0]
    check_offsets(offsets, n_experts, "fp8 grouped w8a8 linear")
    if index is not None and not (
        isinstance(index, Tensor) and index.ndim == 1 and index.dtype in (torch.int32, torch.int64)
    ):
        raise QuantizationError(
            f"fp8 grouped w8a8 linear: index must be int32 / int64 [T] (the activation row of each routed row), "
            f"got {getattr(index, 'dtype', None)} {tuple(getattr(index, 'shape', ()))}"
        )
    rows = xq.shape[0] if index is None else index.shape[0]
    if _w8a8_kernel_takes(xq, q, xs, s, offsets, *(() if index is None else (index,))):
        from skyq.rollout.kernels import triton_fp8_w8a8 as kernels

        return kernels.linear_grouped(xq, xs, q, s, offsets, index=index, out_dtype=out_dtype)
    bounds = offset_bounds(offsets, rows, "fp8 grouped w8a8 linear")
    if index is not None:
        if rows and not (0 <= int(index.min()) and int(index.max()) < xq.shape[0]):
            raise QuantizationError(
                f"fp8 grouped w8a8 linear: index values must lie in [0, {xq.shape[0]}) (rows of the activation codes)"
            )
        xq, xs = xq.view(torch.uint8)[index].view(torch.float8_e4m3fn), xs[index]
    out = torch.empty((rows, q.shape[1]), dtype=out_dtype, device=xq.device)
    for e, (a, b) in enumerate(zip(bounds, bounds[1:])):
        if b > a:
            out[a:b] = fp8_w8a8_linear_reference(xq[a:b], xs[a:b], q[e], s[e], out_dtype=out_dtype)
    return out
