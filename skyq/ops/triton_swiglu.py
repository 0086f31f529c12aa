"""The Triton kernel of `swiglu.silu_mul` (imported only where it runs: CUDA with Triton)."""

from __future__ import annotations

import triton
import triton.language as tl

from skyq.ops.triton_math import round_to

try:
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover - a Triton without the CUDA libdevice bindings
    libdevice = None

BLOCK = 1024
"""Columns a program takes (of one row)."""


@triton.jit
def silu_mul_kernel(g_ptr, u_ptr, y_ptr, W, sg, su, sy, BLOCK: tl.constexpr, EXACT_EXP: tl.constexpr):
    """y[r, c] = dtype(dtype(g / (1 + exp(-g))) * u), in fp32 between the roundings. EXACT_EXP:
    libdevice's expf (what torch's CUDA silu calls); else `tl.exp` (the Triton interpreter has no
    libdevice; the roundings and the layout are what it checks)."""
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = c < W
    g = tl.load(g_ptr + r * sg + c, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + r * su + c, mask=ok, other=0.0).to(tl.float32)
    if EXACT_EXP:
        e = libdevice.exp(-g)
    else:
        e = tl.exp(-g)
    a = round_to(tl.math.div_rn(g, 1.0 + e), y_ptr.dtype.element_ty)
    tl.store(y_ptr + r * sy + c, (a * u).to(y_ptr.dtype.element_ty), mask=ok)


def launch(gate, up, out) -> None:
    """gate, up, out [R, I], unit stride along I; libdevice's exp on CUDA, `tl.exp` under the
    interpreter (CPU tensors)."""
    r, i = gate.shape
    block = min(BLOCK, triton.next_power_of_2(i))
    silu_mul_kernel[(r, triton.cdiv(i, block))](
        gate, up, out, i, gate.stride(0), up.stride(0), out.stride(0), BLOCK=block,
        EXACT_EXP=gate.is_cuda and libdevice is not None, num_warps=4 if block >= 512 else 1,
    )  # fmt: skip
