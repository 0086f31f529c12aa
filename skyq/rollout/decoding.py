"""How the engine runs the forwards of its decode loop: the KV cache, and the CUDA graph of one step.

`DynamicDecoder` is transformers' growing cache, every forward launched from Python: what the
engine does on CPU. On a GPU that loop is launch-bound at the model sizes an RL run samples from:
a decode step is hundreds of small kernels (a few microseconds each on the GPU, tens of
microseconds each of Python and launch), so kernel speed, FP8's included, never shows.
`StaticDecoder` keeps a fixed-capacity cache (`transformers.StaticCache`: preallocated tensors, the
write position a device counter), so every one-token step launches the same kernels on the same
addresses; on CUDA it runs the first such step eagerly (which also compiles every kernel the step
uses), captures the step once in a CUDA graph and replays it for every later token, copying the
new tokens into the graph's input first.

Checks stay loud under replay. The quantizers' finite checks, deferred during capture
(`dispatch.deferred_finite_checks`), are part of the graph: their flags (slots of a pool zeroed once
per call, so the graph replays no kernel that zeroes them) are summed inside it into a running
count. `forward` reads it after each replay by default; the engine reads it one step late instead
(`flags_seen`), so no replay waits for the host. A set flag runs the same validations, in launch
order, on the tensors in hand, so a NaN raises the same `QuantizationError` naming the same tensor
as the eager engine (when the values are gone by then, the engine still fails the call, naming the
step). A host sync inside the step cannot be captured: the engine asks for a graph only
where it knows the step has none (`EmbeddedEngine._step_capturable`), and an unexpected one fails
the capture with an error saying so and how to run without graphs (`rollout.cuda_graphs=false`).

A decoder serves one padded batch size and one cache capacity (`padded_batch`, `cache_capacity`:
few distinct shapes, so graphs are reused across calls); the engine keeps the last few. Padded
rows repeat the last real row and are never sampled. The weights are read in place, so a graph
stays valid across weight updates (`load_weights` copies into the same tensors).
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor, nn

from skyq.quant.kernels import _common
from skyq.rollout.quantized_linear import decode_step

CAPACITY_STEP = 64
"""Cache capacities are multiples of this many positions (prompt + new tokens rounded up)."""


def padded_batch(rows: int) -> int:
    """The batch a graph is captured for: the smallest of 1, 2, 3, 4, 6, 8, 12, 16, 24, ... (2^i and
    3 * 2^i) that holds `rows` (at most half again as many rows; few distinct graphs)."""
    if rows <= 0:
        raise ValueError(f"padded_batch: rows must be positive, got {rows}")
    size = 1
    while size < rows:
        if size % 3 == 0:  # 3 * 2^i -> 2^(i + 2)
            size = size // 3 * 4
        elif size >= 2:  # 2^i -> 3 * 2^(i - 1)
            size = size // 2 * 3
        else:
            size = 2
    return size


def cache_capacity(positions: int) -> int:
    """`positions` (prompt + new tokens) rounded up to a multiple of CAPACITY_STEP."""
    return -(-positions // CAPACITY_STEP) * CAPACITY_STEP


def _last_logits(model: nn.Module, cache_kwarg: str, cache, ids: Tensor, images=None) -> Tensor:
    """[B, V] logits of the last position of `ids` [B, T], the cache extended by T positions. A
    one-token step runs inside `decode_step` (the engine's decode paths at any batch). `images` (a
    multimodal prefill: one `PromptImages` or None per row) go to the model call."""
    extra = {} if images is None else {"images": images}
    with decode_step() if ids.shape[1] == 1 else contextlib.nullcontext():
        out = model(input_ids=ids, **{cache_kwarg: cache}, use_cache=True, logits_to_keep=1, **extra)
    return out.logits[:, -1]


class DynamicDecoder:
    """transformers' growing `DynamicCache`, every forward eager (one decoder per call)."""

    def __init__(self, model: nn.Module, cache_kwarg: str, batch: int) -> None:
        from transformers import DynamicCache

        self.model, self.cache_kwarg, self.batch = model, cache_kwarg, batch
        self.cache = DynamicCache(config=model.config)

    def forward(self, ids: Tensor, *, verify: bool = True, images=None) -> Tensor:
        """Logits [batch, V] of the last position of `ids` [batch, T] (eager: the quantizers' checks
        go to the caller's deferred scope; `verify` is `StaticDecoder.forward`'s; `images`: a
        multimodal prefill's, per row)."""
        return _last_logits(self.model, self.cache_kwarg, self.cache, ids, images)

    def flags_seen(self) -> None:
        """No replays, so no replay flags (see `StaticDecoder.flags_seen`)."""
        return None

    def verify(self) -> None:
        """Nothing to verify: eager steps' checks are the caller's deferred scope's."""

    def seq_length(self) -> int:
        return int(self.cache.get_seq_length())


class CaptureError(RuntimeError):
    """A decode step that cannot be captured in a CUDA graph (it synchronizes with the host)."""


class _GraphChecks(_common.DeferredChecks):
    """The deferred finite checks recorded while a step is captured: kept (never flushed) and
    re-read after a replay, when their tensors hold that replay's values. `seen` also counts every
    replay's flags on the device (from `StaticDecoder.begin`), for a caller that reads them later."""

    def __init__(self, device: torch.device) -> None:
        super().__init__(max_pending=1 << 62)
        self.total: Tensor | None = None
        self.seen = torch.zeros((), dtype=torch.int64, device=device)
        self.flag_pool = _common.FlagPool(device)  # the captured launches' flags: no zeroing kernels

    def reset(self) -> None:
        """Before a new call's replays: no flag set, nothing seen."""
        self.flag_pool.reset()
        self.seen.zero_()

    def sum_in_graph(self) -> None:
        """Called inside the capture after the step: one flag for all of them, computed each replay
        and added to `seen`."""
        if self.pending:
            self.total = torch.cat([flag for flag, _, _ in self.pending]).sum()
            self.seen.add_(self.total)

    def verify(self, *, strict: bool = True) -> None:
        """After a replay: nothing when no flag is set, else the first bad tensor's own error.
        `strict=False`: a set flag whose tensor now validates is let pass (the flag may be an
        earlier replay's: pool flags stay set until `reset`), for the caller to report."""
        if self.total is not None and int(self.total.item()):
            _common.validate_flagged([(flag, check, strict and s) for flag, check, s in self.pending])


class StaticDecoder:
    """A fixed-capacity `StaticCache` for `batch` rows; on CUDA (`graph=True`) the one-token step
    captured once and replayed (see the module docstring). Reusable: `begin` before each call."""

    def __init__(self, model: nn.Module, cache_kwarg: str, batch: int, capacity: int, *, graph: bool) -> None:
        from transformers import StaticCache

        self.model, self.cache_kwarg = model, cache_kwarg
        self.batch, self.capacity, self.use_graph = batch, capacity, graph
        self.cache = StaticCache(config=model.config, max_cache_len=capacity)
        self.replays = 0
        self._graph: torch.cuda.CUDAGraph | None = None
        self._ids: Tensor | None = None
        self._logits: Tensor | None = None
        self._checks: _GraphChecks | None = None

    def begin(self) -> None:
        """Empty the cache for a new call (same tensors: the graph's addresses stay valid)."""
        self.cache.reset()
        if self._checks is not None:
            self._checks.reset()

    def flags_seen(self) -> Tensor | None:
        """A device counter of the quantizers' finite-check flags set in the replays since `begin`
        (None when no step was captured, or it has no checks): read it when convenient, then
        `verify`. Eager steps record their flags in the caller's deferred scope instead."""
        if self._checks is None or self._checks.total is None:
            return None
        return self._checks.seen

    def verify(self) -> None:
        """The checks on the last replay's tensors (one host sync): the first bad tensor's own
        error, if it is there (a flag set by an earlier replay of this call may no longer be)."""
        if self._checks is not None:
            self._checks.verify(strict=False)

    def forward(self, ids: Tensor, *, verify: bool = True, images=None) -> Tensor:
        """Logits [batch, V] of the last position of `ids` [batch, T]; a replayed step's logits are
        the graph's output buffer, valid until the next forward. `verify=False`: a replay's checks
        are left to the caller (`flags_seen`, `verify`), so the replay does not wait for the GPU.
        `images`: a multimodal prefill's, per row (always eager: a prefill is never captured)."""
        if ids.shape[0] != self.batch:
            raise ValueError(f"StaticDecoder for {self.batch} rows given {ids.shape[0]}")
        if ids.shape[1] != 1 or not self.use_graph or images is not None:
            return _last_logits(self.model, self.cache_kwarg, self.cache, ids, images)
        if self._graph is None:
            return self._warm_up_and_capture(ids)
        assert self._ids is not None and self._logits is not None and self._checks is not None
        self._ids.copy_(ids)
        self._graph.replay()
        self.replays += 1
        if verify:
            self._checks.verify()
        return self._logits

    def seq_length(self) -> int:
        return int(self.cache.get_seq_length())

    def _warm_up_and_capture(self, ids: Tensor) -> Tensor:
        """Run this step eagerly on a side stream (it compiles what the step launches), then capture
        the same step, reading its tokens from a static buffer, without running it."""
        side = torch.cuda.Stream(ids.device)
        side.wait_stream(torch.cuda.current_stream(ids.device))
        with torch.cuda.stream(side):
            logits = _last_logits(self.model, self.cache_kwarg, self.cache, ids)
        torch.cuda.current_stream(ids.device).wait_stream(side)
        static_ids = ids.clone()
        graph = torch.cuda.CUDAGraph()
        checks = _GraphChecks(ids.device)
        _common.push_deferred(checks)
        try:
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                out = _last_logits(self.model, self.cache_kwarg, self.cache, static_ids)
                checks.sum_in_graph()
        except RuntimeError as exc:
            raise CaptureError(
                f"the engine's decode step ({self.batch} rows, cache of {self.capacity}) could not be captured "
                f"in a CUDA graph: {exc}. Something in the step synchronizes with the host; run without "
                "graphs with rollout.cuda_graphs=false"
            ) from exc
        finally:
            _common.pop_deferred()
        self._graph, self._ids, self._logits, self._checks = graph, static_ids, out, checks
        return logits
