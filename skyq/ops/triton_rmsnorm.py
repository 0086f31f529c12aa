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
