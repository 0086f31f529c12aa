"""One function per format operation: the Triton kernel for CUDA tensors when Triton imports, the
`skyq.quant` reference everywhere else. Both paths give the same bits and raise the same errors.

Callers (weight sync, converters, fake-quant, the rollout engine) use these and never pick a
path. The kernels cover the shapes real checkpoints use; an unusual block or group shape (not a
power of two) quietly takes the reference path, which is slower but identical.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import Tensor

from skyq.config.enums import Int4Grid
from skyq.quant import fp8_blockwise, int4, mxfp8
from skyq.quant.errors import check_finite
from skyq.quant.kernels import _common


@functools.cache
def triton_available() -> bool:
    """True when Triton can be imported (checked once, without importing it)."""
    return importlib.util.find_spec("triton") is not None


def uses_kernel(t: Tensor) -> bool:
    """Whether an operation on `t` runs a Triton kernel (a CUDA tensor and Triton present)."""
    return isinstance(t, Tensor) and t.is_cuda and triton_available()


def _float_input(w: Tensor) -> bool:
    return isinstance(w, Tensor) and w.is_floating_point() and w.ndim >= 2 and w.numel() > 0


def _int_pair(block_size: Sequence[int]) -> bool:
    return len(block_size) == 2 and all(isinstance(b, int) and b > 0 for b in block_size)


# --- FP8 blockwise -------------------------------------------------------------------------------


def quantize_fp8_blockwise(
    w: Tensor, *, block_size: tuple[int, int] = (128, 128), pow2_scale: bool = False, name: str = "tensor"
) -> tuple[Tensor, Tensor]:
    """`fp8_blockwise.quantize`: `(q e4m3 [..., N, K], weight_scale_inv fp32 [..., ceil(N/bn),
    ceil(K/bk)])`; `pow2_scale` gives the ue8m0 (power-of-two) scales."""
    if uses_kernel(w) and _float_input(w) and _int_pair(block_size):
        from skyq.quant.kernels import triton_fp8_blockwise as kernels

        if kernels.supports(tuple(block_size)):
            return kernels.quantize(w, block_size=tuple(block_size), pow2_scale=pow2_scale, name=name)
    return fp8_blockwise.quantize(w, block_size=block_size, pow2_scale=pow2_scale, name=name)


def fake_quant_fp8_blockwise(
    w: Tensor, *, block_size: tuple[int, int] = (128, 128), pow2_scale: bool = False, name: str = "tensor"
) -> Tensor:
    """`fp8_blockwise.quantize` then dequantize to w's dtype (what the trainer's fake quant and the
    engine's W8A8 inputs compute): one kernel pass on CUDA, the reference elsewhere."""
    if uses_kernel(w) and _float_input(w) and _int_pair(block_size):
        from skyq.quant.kernels import triton_fp8_blockwise as kernels

        if kernels.supports(tuple(block_size)):
            return kernels.fake_quantize(w, block_size=tuple(block_size), pow2_scale=pow2_scale, name=name)
    q, scale_inv = fp8_blockwise.quantize(w, block_size=block_size, pow2_scale=pow2_scale, name=name)
    return fp8_blockwise._dequantize(q, scale_inv, *block_size, w.dtype)


def quantize_fp8_blockwise_group(
    ws: Sequence[Tensor],
    names: Sequence[str],
    *,
    block_size: tuple[int, int] = (128, 128),
    pow2_scale: bool = False,
    out: Sequence[tuple[Tensor, Tensor]] | None = None,
) -> list[tuple[Tensor, Tensor]]:
    """`quantize_fp8_blockwise(ws[i], name=names[i])` for every i, the same bits: on CUDA one kernel
    launch for all of them (the per-call launch cost, not bandwidth, bounds a weight sync's many
    small quantizations) and one finite check for the group; elsewhere one call each. `out`: per
    tensor, contiguous (q, scale_inv) of the result's shapes to write into (a weight sync's bucket
    bytes), which are then returned."""
    if (
        ws
        and all(uses_kernel(w) and _float_input(w) and w.device == ws[0].device for w in ws)
        and _int_pair(block_size)
        and _outputs_ok(out, ws[0].device)
    ):
        from skyq.quant.kernels import triton_fp8_blockwise as kernels

        if kernels.group_supports(list(ws), tuple(block_size)):
            qs, ss, flags = kernels.launch_quantize_group(
                list(ws), block_size=tuple(block_size), pow2_scale=pow2_scale, out=out
            )

            def validate() -> None:  # the first non-finite input, named as the per-call check names it
                for w, name in zip(ws, names):
                    fp8_blockwise.quantize(w, block_size=block_size, name=name)

            _common.raise_if_flagged(flags.amax(), validate)
            if out is not None:
                return list(out)
            return [
                (q.reshape(w.shape), s.reshape(*w.shape[:-2], *s.shape[-2:])) for w, q, s in zip(ws, qs, ss)
            ]
    results = [
        quantize_fp8_blockwise(w, block_size=block_size, pow2_scale=pow2_scale, name=name)
        for w, name in zip(ws, names)
    ]
    return _written(results, out)


def _outputs_ok(out: Sequence[tuple[Tensor, ...]] | None, device: torch.device) -> bool:
    """No `out`, or every output a contiguous tensor on `device` (what a grouped kernel writes)."""
    return out is None or all(t.device == device and t.is_contiguous() for ts in out for t in ts)


def _written(results: list[tuple[Tensor, Tensor]], out: Sequence[tuple[Tensor, Tensor]] | None):
    """`results`, or copied into `out` (of the same shapes and dtypes) and `out` returned."""
    if out is None:
        return results
    if len(out) != len(results):
        raise ValueError(f"{len(out)} outputs for {len(results)} tensors")
    pairs = [(t, d) for got, dst in zip(results, out) for t, d in zip(got, dst, strict=True)]
    for t, d in pairs:  # all checked before any is written
        if (t.shape, t.dtype) != (d.shape, d.dtype):
            raise ValueError(
                f"an output of {d.dtype}{list(d.shape)} for a result of {t.dtype}{list(t.shape)}"
            )
    for t, d in pairs:
        d.copy_(t)
    return list(out)


def dequantize_fp8_blockwise(
    q: Tensor,
    scale_inv: Tensor,
    *,
    block_size: tuple[int, int] = (128, 128),
    dtype: torch.dtype = torch.bfloat16,
    name: str = "tensor",
) -> Tensor:
    """`fp8_blockwise.dequantize`: `q * weight_scale_inv[i // bn, j // bk]` in fp32, cast to `dtype`."""
    if uses_kernel(q) and scale_inv.is_cuda and _int_pair(block_size):
        from skyq.quant.kernels import triton_fp8_blockwise as kernels

        return kernels.dequantize(q, scale_inv, block_size=tuple(block_size), dtype=dtype, name=name)
    return fp8_blockwise.dequantize(q, scale_inv, block_size=block_size, dtype=dtype, name=name)


def quantize_fp8_activation(
    x: Tensor, *, tile: int = 128, pow2_scale: bool = False, name: str = "activation"
) -> tuple[Tensor, Tensor]:
    """`fp8_blockwise.quantize_activation`: 1 x `tile` blocks along K, scales [..., M, ceil(K/tile)]."""
    return quantize_fp8_blockwise(x, block_size=(1, tile), pow2_scale=pow2_scale, name=name)


# --- MXFP8 ---------------------------------------------------------------------------------------


def quantize_mxfp8(w: Tensor, *, name: str = "tensor", allow_pad: bool = False) -> tuple[Tensor, Tensor]:
    """`mxfp8.quantize`: `(q e4m3 [..., N, K], scale uint8 [..., N, ceil(K/32)])`."""
    if uses_kernel(w) and _float_input(w):
        from skyq.quant.kernels import triton_mxfp8 as kernels

        return kernels.quantize(w, name=name, allow_pad=allow_pad)
    return mxfp8.quantize(w, name=name, allow_pad=allow_pad)


def fake_quant_mxfp8(w: Tensor, *, name: str = "tensor") -> Tensor:
    """`mxfp8.quantize` then dequantize to w's dtype (the trainer's MXFP8 fake quant of weights and
    activations, and the engine's MXFP8 inputs): one kernel pass on CUDA, the reference elsewhere."""
    if uses_kernel(w) and _float_input(w):
        from skyq.quant.kernels import triton_mxfp8 as kernels

        return kernels.fake_quantize(w, name=name)
    return mxfp8._dequantize(*mxfp8.quantize(w, name=name), w.dtype)


def quantize_mxfp8_group(
    ws: Sequence[Tensor], names: Sequence[str], *, out: Sequence[tuple[Tensor, Tensor]] | None = None
) -> list[tuple[Tensor, Tensor]]:
    """`quantize_mxfp8(ws[i], name=names[i])` for every i, the same bits: on CUDA one kernel launch
    for all of them and one finite check for the group; elsewhere one call each. `out`: as
    `quantize_fp8_blockwise_group` takes it."""
    if (
        ws
        and all(uses_kernel(w) and _float_input(w) and w.device == ws[0].device for w in ws)
        and _outputs_ok(out, ws[0].device)
    ):
        from skyq.quant.kernels import triton_mxfp8 as kernels

        if kernels.group_supports(list(ws)):
            qs, ss, flags = kernels.launch_quantize_group(list(ws), out=out)

            def validate() -> None:  # the first non-finite input, named as the per-call check names it
                for w, name in zip(ws, names):
                    mxfp8.quantize(w, name=name)

            _common.raise_if_flagged(flags.amax(), validate)
            if out is not None:
                return list(out)
            return [
                (q.reshape(w.shape), s.reshape(*w.shape[:-1], s.shape[-1])) for w, q, s in zip(ws, qs, ss)
            ]
    return _written([quantize_mxfp8(w, name=name) for w, name in zip(ws, names)], out)


def dequantize_mxfp8(
    q: Tensor, scale_u8: Tensor, *, dtype: torch.dtype = torch.bfloat16, name: str = "tensor"
) -> Tensor:
    """`mxfp8.dequantize`: `q * 2^(scale - 127)` (exact), cast to `dtype`."""
    if uses_kernel(q) and scale_u8.is_cuda:
        from skyq.quant.kernels import triton_mxfp8 as kernels

        return kernels.dequantize(q, scale_u8, dtype=dtype, name=name)
    return mxfp8.dequantize(q, scale_u8, dtype=dtype, name=name)


# --- INT4 ----------------------------------------------------------------------------------------


def _int4_kernel_ok(w: Tensor, group_size: int, grid: Int4Grid | str) -> bool:
    if not (uses_kernel(w) and _float_input(w) and grid in _INT4_GRIDS):
        return False
    from skyq.quant.kernels import triton_int4 as kernels

    return kernels.supports(group_size) and w.shape[-1] % group_size == 0


_INT4_GRIDS = {g.value for g in Int4Grid}


def quantize_int4(
    w: Tensor, *, group_size: int, grid: Int4Grid | str = Int4Grid.kimi, name: str = "tensor"
) -> tuple[Tensor, Tensor]:
    """`int4.quantize`: `(codes int8 [..., N, K], scale bf16 [..., N, K/G])`."""
    if _int4_kernel_ok(w, group_size, grid):
        from skyq.quant.kernels import triton_int4 as kernels

        codes, _, scale = kernels.quantize(w, group_size=group_size, grid=grid, name=name, codes=True)
        return codes, scale
    return int4.quantize(w, group_size=group_size, grid=grid, name=name)


def quantize_int4_packed(
    w: Tensor, *, group_size: int, grid: Int4Grid | str = Int4Grid.kimi, name: str = "tensor"
) -> tuple[Tensor, Tensor]:
    """`int4.pack(int4.quantize(w))` in one pass: `(weight_packed int32 [..., N, K/8], weight_scale
    bf16 [..., N, K/G])`, the compressed-tensors `pack-quantized` tensors."""
    if _int4_kernel_ok(w, group_size, grid):
        from skyq.quant.kernels import triton_int4 as kernels

        _, packed, scale = kernels.quantize(
            w, group_size=group_size, grid=grid, name=name, codes=False, packed=True
        )
        return packed, scale
    q, scale = int4.quantize(w, group_size=group_size, grid=grid, name=name)
    return int4.pack(q, name=name), scale


def quantize_int4_packed_group(
    ws: Sequence[Tensor],
    names: Sequence[str],
    *,
    group_size: int,
    grid: Int4Grid | str = Int4Grid.kimi,
    out: Sequence[tuple[Tensor, Tensor]] | None = None,
) -> list[tuple[Tensor, Tensor]]:
    """`quantize_int4_packed(ws[i], name=names[i])` for every i, the same bits: on CUDA one kernel
    launch for all of them and one finite check for the group; elsewhere one call each. `out`: as
    `quantize_fp8_blockwise_group` takes it."""
    if (
        ws
        and all(_int4_kernel_ok(w, group_size, grid) and w.device == ws[0].device for w in ws)
        and _outputs_ok(out, ws[0].device)
    ):
        from skyq.quant.kernels import triton_int4 as kernels

        if kernels.group_supports(list(ws), group_size):
            packs, scales, flags = kernels.launch_quantize_group(
                list(ws), group_size=group_size, grid=grid, out=out
            )

            def validate() -> None:  # the first non-finite input, named as the per-call check names it
                for w, name in zip(ws, names):
                    int4.quantize(w, group_size=group_size, grid=grid, name=name)

            _common.raise_if_flagged(flags.amax(), validate)
            if out is not None:
                return list(out)
            return [
                (p.reshape(*w.shape[:-1], p.shape[-1]), s.reshape(*w.shape[:-1], s.shape[-1]))
                for w, p, s in zip(ws, packs, scales)
            ]
    return _written(
        [quantize_int4_packed(w, group_size=group_size, grid=grid, name=name) for w, name in zip(ws, names)],
        out,
    )


def dequantize_int4_packed(
    packed: Tensor,
    scale: Tensor,
    weight_shape: Tensor | Sequence[int],
    *,
    group_size: int | None = None,
    dtype: torch.dtype = torch.bfloat16,
    name: str = "tensor",
) -> Tensor:
    """`int4.dequantize_packed` (symmetric): dense [..., N, K] = codes * scale in the scale's dtype."""
    if uses_kernel(packed) and scale.is_cuda and packed.dtype == torch.int32 and scale.is_floating_point():
        from skyq.quant.kernels import triton_int4 as kernels

        n, k = (int(v) for v in (weight_shape.tolist() if isinstance(weight_shape, Tensor) else weight_shape))
        g = (
            group_size
            if group_size is not None
            else (k // scale.shape[-1] if scale.ndim and scale.shape[-1] else 0)
        )
        shapes_ok = (
            packed.ndim >= 2
            and tuple(packed.shape[-2:]) == (n, k // 8)
            and k % 8 == 0
            and kernels.supports(g)
            and k % g == 0
            and tuple(scale.shape) == (*packed.shape[:-1], k // g)
        )
        if shapes_ok:
            check_finite(scale, f"{name} weight_scale")
            return kernels.dequantize_packed(packed, scale, n, k, g, dtype)
    return int4.dequantize_packed(packed, scale, weight_shape, group_size=group_size, dtype=dtype, name=name)


# --- batched finite checks -----------------------------------------------------------------------


@contextlib.contextmanager
def deferred_finite_checks(*, max_pending: int = 1024) -> Iterator[_common.DeferredChecks]:
    """Check many CUDA quantizations with one host sync instead of one per call.

    Inside the scope the kernel paths above (and `check_finite_deferred`) record their device-side
    non-finite flag instead of reading it; the flags are summed and read once when the scope exits
    (and every `max_pending` calls). Outputs produced inside the scope must not be used before it
    exits cleanly: on a bad input it raises the same `QuantizationError`, naming the first bad
    tensor in call order, that the per-call check would have raised. CPU calls check at once.
    """
    scope = _common.DeferredChecks(max_pending)
    _common.push_deferred(scope)
    try:
        yield scope
    finally:
        _common.pop_deferred()
    scope.flush()


def check_finite_deferred(t: Tensor, name: str) -> None:
    """`errors.check_finite`; on a CUDA tensor inside `deferred_finite_checks`, recorded (sum test on
    the device, exact check only if that sum is not finite) instead of synced now."""
    scope = _common.active_deferred()
    if scope is None or not t.is_cuda or t.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        check_finite(t, name)
        return
    scope.add(
        torch.isfinite(t.sum(dtype=torch.float32)).logical_not(), lambda: check_finite(t, name), strict=False
    )


def check_flag_deferred(flag: Tensor, validate: Callable[[], None]) -> None:
    """Run `validate` (which must raise) when the device-side boolean `flag` is set: read now, or,
    on a CUDA tensor inside `deferred_finite_checks`, recorded and read with the scope's other
    flags (one host sync for all). For a guard whose failure leaves nothing out of bounds, so the
    work queued before the scope's read is harmless."""
    if flag.is_cuda:
        _common.raise_if_flagged(flag, validate)
    elif bool(flag):
        validate()
        raise AssertionError("a check's flag was set but its validation passed")


def check_finite_stack_deferred(stack: Tensor, names: Sequence[str]) -> None:
    """`check_finite_deferred(stack[i], names[i])` for every i, with one device test for the whole
    stack inside `deferred_finite_checks`; a bad stack is then checked member by member, in order,
    so the first bad tensor is named exactly as the per-tensor check names it."""

    def validate() -> None:
        for i, name in enumerate(names):
            check_finite(stack[i], name)

    scope = _common.active_deferred()
    if (
        scope is None
        or not stack.is_cuda
        or stack.dtype not in (torch.float16, torch.bfloat16, torch.float32)
    ):
        validate()
        return
    scope.add(torch.isfinite(stack.sum(dtype=torch.float32)).logical_not(), validate, strict=False)
