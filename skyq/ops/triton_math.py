"""Triton helpers shared by skyq's kernels (imported only where Triton runs)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def round_to(x, DTYPE: tl.constexpr):
    """fp32 x rounded to DTYPE (round to nearest even) and widened back exactly: a torch op whose
    result is a tensor of DTYPE. bf16 widens through its bit pattern (a shift), so the compiler
    cannot fold the round trip away; fp32 is returned as it is. The fp16 round trip is not so
    protected (a kernel that must equal torch's fp16 bits differed on the H200), and fp32 products
    may be fused with a following add into one FMA: kernels bit-equal to torch take bf16 only."""
    if DTYPE == tl.bfloat16:
        return (x.to(DTYPE).to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    elif DTYPE == tl.float32:
        return x
    else:
        return x.to(DTYPE).to(tl.float32)
