"""The Triton kernel of `rmsnorm.rms_norm` (imported only where it runs: CUDA with Triton)."""

from __future__ import annotations

import triton
import triton.language as tl

from skyq.ops.triton_math import round_to

ELEMENTS_PER_PROGRAM = 4096
"""A program normalizes max(1, this // next_pow2(N)) rows of N: whole rows only, so every row's
sum runs the same reduction whichever program, position or batch it is in."""


@triton.jit(do_not_specialize=["R"])  # one compiled kernel for one row and for many
def rms_norm_kernel(
    x_ptr, w_ptr, y_ptr, R, N, sxr, syr, eps, inv_n, ROWS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """y[r] = w * in_dtype(x[r] * rsqrt(sum(x[r]^2) * inv_n + eps)), the product rounded to y's
    dtype; x in fp32 throughout, as the transformers formula."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    c_ok = cols < N
    mask = (rows < R)[:, None] & c_ok[None, :]
    x = tl.load(x_ptr + rows[:, None] * sxr + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    variance = tl.sum(x * x, axis=1) * inv_n
    h = round_to(x * tl.math.rsqrt(variance + eps)[:, None], x_ptr.dtype.element_ty)
    w = tl.load(w_ptr + cols, mask=c_ok, other=0.0).to(tl.float32)
    y = (w[None, :] * h).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + rows[:, None] * syr + cols[None, :], y, mask=mask)


def launch(x2, weight, y2, eps: float) -> None:
    """x2 [R, N] and y2 [R, N] with unit stride along N, weight [N]. The tiling depends on N only."""
    r, n = x2.shape
    block = triton.next_power_of_2(n)
    rows = max(1, ELEMENTS_PER_PROGRAM // block)
    warps = 4 if block <= ELEMENTS_PER_PROGRAM else 8  # a row wider than a program's share
    rms_norm_kernel[(triton.cdiv(r, rows),)](
        x2, weight, y2, r, n, x2.stride(0), y2.stride(0), eps, 1.0 / n, ROWS=rows, BLOCK=block, num_warps=warps,
    )  # fmt: skip


@triton.jit(do_not_specialize=["R"])
def rms_norm_backward_kernel(
    x_ptr, w_ptr, dy_ptr, dx_ptr, dwp_ptr, R, N, sxr, sdyr, sdxr, eps, inv_n, blocks_per_program,
    ROWS: tl.constexpr, BLOCK: tl.constexpr, NEED_DW: tl.constexpr,
):  # fmt: skip
    """The gradient of `rms_norm_kernel`'s formula (`rmsnorm.rms_norm_reference`) for blocks of ROWS
    rows, this program's blocks strided by the grid: with r = rsqrt(mean(x^2) + eps), h = x r in x's
    dtype and g = in_dtype(dy w) widened to fp32 (the gradient through the narrowing),
    dx = r g - x r^3 sum(g x) / N; dw (NEED_DW) summed over the program's rows in fp32 from dy h, into
    row `program` of dwp [programs, N]."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    c_ok = cols < N
    w = tl.load(w_ptr + cols, mask=c_ok, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(0, blocks_per_program):
        rows = (pid.to(tl.int64) + i * tl.num_programs(0)) * ROWS + tl.arange(0, ROWS)
        mask = (rows < R)[:, None] & c_ok[None, :]
        x = tl.load(x_ptr + rows[:, None] * sxr + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + rows[:, None] * sdyr + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        r = tl.math.rsqrt(tl.sum(x * x, axis=1) * inv_n + eps)[:, None]
        g = round_to(round_to(dy * w[None, :], dy_ptr.dtype.element_ty), x_ptr.dtype.element_ty)
        dot = tl.sum(g * x, axis=1)[:, None]
        dx = g * r - x * (r * r * r) * (dot * inv_n)
        tl.store(dx_ptr + rows[:, None] * sdxr + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)
        if NEED_DW:
            h = round_to(x * r, x_ptr.dtype.element_ty)
            dw += tl.sum(tl.where(mask, dy * h, 0.0), axis=0)
    if NEED_DW:
        tl.store(dwp_ptr + pid.to(tl.int64) * N + cols, dw, mask=c_ok)


def launch_backward(x2, weight, dy2, dx2, eps: float, need_dw: bool, programs: int):
    """dx2 [R, N] (written) and, with `need_dw`, the fp32 partial sums of dw [programs', N] (returned,
    to be summed over dim 0) for x2, dy2 [R, N] with unit stride along N and weight [N]."""
    import torch

    r, n = x2.shape
    block = triton.next_power_of_2(n)
    rows = max(1, ELEMENTS_PER_PROGRAM // block)
    warps = 4 if block <= ELEMENTS_PER_PROGRAM else 8
    row_blocks = triton.cdiv(r, rows)
    grid = max(1, min(programs, row_blocks))
    per = triton.cdiv(row_blocks, grid)
    partial = torch.empty((grid, n) if need_dw else (1,), dtype=torch.float32, device=x2.device)
    rms_norm_backward_kernel[(grid,)](
        x2, weight, dy2, dx2, partial, r, n, x2.stride(0), dy2.stride(0), dx2.stride(0), eps, 1.0 / n, per,
        ROWS=rows, BLOCK=block, NEED_DW=need_dw, num_warps=warps,
    )  # fmt: skip
    return partial
