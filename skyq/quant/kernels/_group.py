"""What the grouped quantize kernels share (`triton_fp8_blockwise`, `triton_mxfp8`, `triton_int4`): one launch for
many tensors, each described by a row of an int64 table on the device.

Row of tensor t (`GROUP_COLS` int64): x, q and scale addresses, N, K, the three x strides, its first
program, programs per [N, K] matrix, programs along K. A program finds its row by a binary search
over the `first` column (`group_member`). Addresses read from a table carry no alignment Triton
could see, so `GroupTable.aligned` says when every x is K-contiguous with 16-byte aligned rows
(the kernels then hint 16-byte vectors). A kernel casts the x address to its pointer itself: a
`tl.multiple_of` hint on a value a jit function returned does not survive inlining.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor

from skyq.quant.kernels._common import as_3d

GROUP_COLS = tl.constexpr(11)
GROUP_DTYPES = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}
"""Input dtypes a group may have (one per launch), as the kernels' DT code."""


@triton.jit
def group_member(tbl_ptr, n_tensors, LOG: tl.constexpr):
    """(t, its table row, this program's index among t's programs)."""
    pid = tl.program_id(0).to(tl.int64)
    lo = pid * 0
    hi = lo + n_tensors
    for _ in tl.static_range(LOG):
        mid = (lo + hi) // 2
        go = tl.load(tbl_ptr + mid * GROUP_COLS + 8) <= pid
        lo = tl.where(go, mid, lo)
        hi = tl.where(go, hi, mid)
    row = tbl_ptr + lo * GROUP_COLS
    return lo, row, pid - tl.load(row + 8)


@triton.jit
def group_input(row, DT: tl.constexpr):
    """The tensor's input pointer (table column 0) typed by the launch's DT code (`GROUP_DTYPES`)."""
    p = tl.load(row)
    if DT == 0:
        x_ptr = p.to(tl.pointer_type(tl.bfloat16))
    elif DT == 1:
        x_ptr = p.to(tl.pointer_type(tl.float16))
    else:
        x_ptr = p.to(tl.pointer_type(tl.float32))
    return x_ptr


@triton.jit
def group_tile(row, local):
    """This program's place in its tensor, from the tensor's table row: (N, the three x strides
    (batch, row, column), programs per matrix, matrix b, tile within it, tile row pid_n, tile column
    pid_k). The addresses and K, which the kernels hint, they read themselves."""
    n = tl.load(row + 3)
    sxb = tl.load(row + 5)
    sxn = tl.load(row + 6)
    sxk = tl.load(row + 7)
    tiles = tl.load(row + 9)
    n_tiles_k = tl.load(row + 10)
    b = local // tiles
    tile = local % tiles
    return n, sxb, sxn, sxk, tiles, b, tile, tile // n_tiles_k, tile % n_tiles_k


def group_ok(ws: list[Tensor]) -> bool:
    """One input dtype of `GROUP_DTYPES`, every tensor 2-D or 3-D and non-empty."""
    return (
        bool(ws)
        and ws[0].dtype in GROUP_DTYPES
        and all(w.dtype == ws[0].dtype and w.ndim in (2, 3) and w.numel() for w in ws)
    )


class GroupTable:
    """The rows of one grouped launch, built tensor by tensor (`add`), then uploaded (`args`)."""

    def __init__(self, ws: list[Tensor]) -> None:
        self.device = ws[0].device
        self.dtype_code = GROUP_DTYPES[ws[0].dtype]
        self.n = len(ws)
        self._words = 16 // ws[0].element_size()
        self.rows: list[tuple[int, ...]] = []
        self.programs = 0
        self.aligned = True

    def output(
        self,
        out: Sequence[Sequence[Tensor]] | None,
        i: int,
        k: int,
        shape: tuple[int, ...],
        dtype: torch.dtype,
    ) -> Tensor:
        """Output `k` of tensor `i`: `out[i][k]` (contiguous, `dtype`, as many elements as `shape`,
        on the group's device; the kernels write it as a flat [shape] array) or a new tensor."""
        if out is None:
            return torch.empty(shape, dtype=dtype, device=self.device)
        t = out[i][k]
        if (
            t.dtype != dtype
            or t.numel() != math.prod(shape)
            or not t.is_contiguous()
            or t.device != self.device
        ):
            raise ValueError(
                f"grouped quantize output {k} of tensor {i}: {t.dtype}{list(t.shape)} "
                f"(contiguous {t.is_contiguous()}, {t.device}), needs {dtype}{list(shape)} contiguous on {self.device}"
            )
        return t

    def add(self, w: Tensor, q: Tensor, s: Tensor, tiles: int, tiles_k: int) -> None:
        """Tensor `w` ([N, K] or [B, N, K]) quantized into `q` and `s` by `tiles` programs per
        matrix, `tiles_k` of them along K."""
        x = as_3d(w)
        nb, n, k = x.shape
        sb, sn, sk = x.stride()
        self.aligned = (
            self.aligned and sk == 1 and k % 16 == 0 and x.data_ptr() % 16 == 0
            and sb % self._words == 0 and sn % self._words == 0 and q.data_ptr() % 16 == 0
        )  # fmt: skip
        self.rows.append(
            (x.data_ptr(), q.data_ptr(), s.data_ptr(), n, k, sb, sn, sk, self.programs, tiles, tiles_k)
        )
        self.programs += nb * tiles

    def args(self) -> tuple[Tensor, Tensor, int]:
        """(the table on the device, zeroed int32 flags, one per tensor; binary-search steps)."""
        table = torch.tensor(self.rows, dtype=torch.int64)
        if self.device.type == "cuda":  # a pinned staging copy: queued on the stream, no host wait
            table = table.pin_memory().to(self.device, non_blocking=True)
        flags = torch.zeros(self.n, dtype=torch.int32, device=self.device)
        return table, flags, max(1, (self.n - 1).bit_length())
