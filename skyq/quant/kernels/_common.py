"""Launch helpers shared by the Triton kernel modules (torch only; no Triton import here)."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable

import torch
from torch import Tensor

FLT_MAX = float(torch.finfo(torch.float32).max)


def as_3d(w: Tensor) -> Tensor:
    """View `w` [..., N, K] as [B, N, K] without copying when the leading dims allow it.

    The kernels take arbitrary strides for the last three dims, so transposed and strided weights
    are read in place; only a >3-D tensor whose leading dims cannot be merged is copied.
    """
    if w.ndim == 2:
        return w.unsqueeze(0)
    if w.ndim == 3:
        return w
    return w.reshape(-1, *w.shape[-2:])


def new_flag(device: torch.device) -> Tensor:
    """One int32 counter the kernels bump when a tile holds an invalid input (NaN/inf, NaN code):
    a slot of the active deferred scope's `FlagPool` when it has one (no kernel to zero it), else
    a fresh zeroed tensor."""
    pool = getattr(active_deferred(), "flag_pool", None)
    flag = pool.take(device) if pool is not None else None
    return flag if flag is not None else torch.zeros(1, dtype=torch.int32, device=device)


class FlagPool:
    """Zeroed int32 flags allocated once and handed out one slot per launch, so launches captured
    in a CUDA graph do not each replay a kernel that zeroes their flag. The slots are zeroed only by
    `reset` (eagerly, between uses), so within a use a set flag stays set."""

    def __init__(self, device: torch.device, size: int = 1024) -> None:
        self.flags = torch.zeros(size, dtype=torch.int32, device=device)
        self.used = 0

    def take(self, device: torch.device) -> Tensor | None:
        """The next free slot ([1] view), None when full or on another device."""
        if self.used >= self.flags.numel() or self.flags.device != torch.device(device):
            return None
        self.used += 1
        return self.flags[self.used - 1 : self.used]

    def reset(self) -> None:
        self.flags.zero_()


class DeferredChecks:
    """Flags of kernel launches whose check was deferred: read together with one host sync.

    Entries keep `validate` (and so the input it closes over) alive until the next `flush`; the
    scope flushes every `max_pending` entries to bound that."""

    flag_pool: FlagPool | None = None
    """Where `new_flag` takes the flags of launches made in this scope (None: fresh tensors)."""

    def __init__(self, max_pending: int) -> None:
        self.max_pending = max_pending
        self.pending: list[tuple[Tensor, Callable[[], None], bool]] = []

    def add(self, flag: Tensor, validate: Callable[[], None], *, strict: bool) -> None:
        """`strict`: a set flag must make `validate` raise (kernel flags); else a set flag may be a
        false alarm that `validate` clears (a sum that overflowed on finite values)."""
        self.pending.append((flag.reshape(1).to(torch.int32), validate, strict))
        if len(self.pending) >= self.max_pending:
            self.flush()

    def flush(self) -> None:
        """One sync per device for all pending flags; on a set flag, run the validations in launch
        order so the first offending tensor is named exactly as the per-call check names it."""
        pending, self.pending = self.pending, []
        by_device: dict[torch.device, list[Tensor]] = {}
        for flag, _, _ in pending:
            by_device.setdefault(flag.device, []).append(flag)
        if not any(int(torch.cat(flags).sum().item()) for flags in by_device.values()):
            return
        validate_flagged(pending)


def validate_flagged(pending: list[tuple[Tensor, Callable[[], None], bool]]) -> None:
    """Run the validation of every set flag, in launch order (the first bad input raises its own
    error); a strict flag whose validation passes is a kernel bug."""
    for flag, validate, strict in pending:
        if int(flag.item()):
            validate()
            if strict:
                raise AssertionError(
                    "a kernel flagged an invalid input that the reference validation accepted"
                )


_deferred = threading.local()


def active_deferred() -> DeferredChecks | None:
    """The innermost deferred-check scope of this thread, if any."""
    stack = getattr(_deferred, "stack", None)
    return stack[-1] if stack else None


def push_deferred(scope: DeferredChecks) -> None:
    if not hasattr(_deferred, "stack"):
        _deferred.stack = []
    _deferred.stack.append(scope)


def pop_deferred() -> DeferredChecks:
    return _deferred.stack.pop()


def raise_if_flagged(flag: Tensor, validate: Callable[[], None]) -> None:
    """Read the kernel's flag (one host sync) and, when set, run the reference's own validation,
    which raises the same `QuantizationError` (same wording) the reference would have. Inside a
    deferred scope (`dispatch.deferred_finite_checks`) the flag is only recorded."""
    scope = active_deferred()
    if scope is not None:
        scope.add(flag, validate, strict=True)
        return
    if int(flag.item()):
        validate()
        raise AssertionError("a kernel flagged an invalid input that the reference validation accepted")


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Multiprocessors of `device`, which persistent and split launches size their grids by; an
    H200's 132 for CPU tensors (the Triton interpreter)."""
    return _sm_count(device.index or 0) if device.type == "cuda" else 132
