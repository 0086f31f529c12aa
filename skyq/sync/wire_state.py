"""What a commit receives, and the copy that installs it into an engine's fixed buffers.

The receiver hands a commit a `WireState`: a read-only mapping (wire name -> tensor of the
manifest's dtype and shape, views into the received frames, made on first use) that also knows the
runs it was cut from. `WireCopier`
copies one into an engine's preallocated tensors with one multi-tensor copy per integer word size,
each tensor's bytes seen as 8-byte words where its size and address allow: a copy of e4m3 codes
then moves as few elements as one of int64, so an fp8 sync copies half the elements of a bf16 one,
not as many. A run whose destinations lie stacked in one storage (a serving engine's [E, N, K]
experts) is one strided copy instead, with no per-member view on either side. The destination
views are built once per layout and kept; no per-tensor Python runs on a repeat sync. Any other mapping (or a tensor that cannot be copied as bytes) takes the typed
path: one multi-tensor copy per device and dtype pair.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence

import torch
from torch import Tensor

from skyq.sync.byte_runs import Run, WordRun, run_views, word_dtype, word_runs


class WireState(Mapping[str, Tensor]):
    """A verified wire state (wire name -> tensor of the manifest's dtype and shape), cut from the
    received frames by the layout's runs. A read-only mapping whose tensors are made on first use,
    a whole run at a time (views into the frames, one `unbind` per run): a commit that copies
    `word_runs()` makes no typed view at all."""

    __slots__ = ("_frames", "_runs", "_index", "_views", "_words", "layout")

    def __init__(
        self,
        *,
        frames: Sequence[Tensor],
        runs: Sequence[Sequence[Run]],
        index: Mapping[str, tuple[int, int, int]],
        layout: str,
    ) -> None:
        self._frames = tuple(frames)
        self._runs = runs
        self._index = index
        """Name -> (bucket, run, member), in byte order (`wire_index`)."""
        self._views: dict[tuple[int, int], Sequence[Tensor]] = {}
        self._words: list[WordRun] | None = None
        self.layout = layout
        """The digest of the layout the frames follow: equal digests, equal runs."""

    def __getitem__(self, name: str) -> Tensor:
        bucket, run, member = self._index[name]
        views = self._views.get((bucket, run))
        if views is None:
            views = self._views[bucket, run] = run_views(self._frames[bucket], self._runs[bucket][run])
        return views[member]

    def __iter__(self) -> Iterator[str]:
        return iter(self._index)

    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, name: object) -> bool:
        return name in self._index

    def to(self, device: torch.device | str) -> WireState:
        """The same state with its frames on `device`: one copy per frame, the runs and the layout
        kept (so a commit's kept destination views still apply); `self` when they are there already.
        An engine on a GPU that received host frames (gloo, from a trainer on the same GPU) verifies
        and installs them there, rather than dequantizing every weight on the host and copying
        tensor by tensor."""
        frames = [frame.to(device) for frame in self._frames]  # `to` returns a frame already there
        if all(moved is frame for moved, frame in zip(frames, self._frames)):
            return self
        return WireState(frames=frames, runs=self._runs, index=self._index, layout=self.layout)

    def word_runs(self) -> list[WordRun]:
        """The tensors (of more than 0 bytes, not bool) as flat integer-word views of their bytes, run
        by run (`byte_runs.word_runs`): the same bytes as the typed views. Made once, then kept (the
        receiver makes them while the device verifies the frames)."""
        if self._words is None:
            out: list[WordRun] = []
            for frame, runs in zip(self._frames, self._runs, strict=True):
                out.extend(word_runs(frame, runs))
            self._words = out
        return self._words


def wire_index(runs: Sequence[Sequence[Run]]) -> dict[str, tuple[int, int, int]]:
    """Where each tensor of a layout lies: name -> (bucket, run, member), in byte order."""
    return {
        name: (b, r, k)
        for b, bucket_runs in enumerate(runs)
        for r, run in enumerate(bucket_runs)
        for k, name in enumerate(run.names)
    }


def _word_view(t: Tensor, word: torch.dtype) -> Tensor | None:
    """`t`'s bytes as a flat tensor of `word`, or None when `t` is not contiguous or not aligned."""
    nbytes = t.numel() * t.element_size()
    if (
        not t.is_contiguous()
        or t.dtype == torch.bool
        or word_dtype(nbytes, t.data_ptr()).itemsize < word.itemsize
    ):
        return None
    return t.reshape(-1).view(torch.uint8).view(word)


def stacked_view(targets: Sequence[Tensor]) -> Tensor | None:
    """The flat, equal-sized word views `targets` as the rows of ONE strided [n, words] view, when
    they lie in one storage at one constant pitch in order (an engine that holds a projection's
    experts stacked, as serving engines do): a whole run then installs with one copy. None when
    they do not (separate allocations, gaps that vary, overlap)."""
    if len(targets) < 2:
        return None
    first = targets[0]
    size, item = first.numel(), first.element_size()
    pitch = targets[1].data_ptr() - first.data_ptr()
    if pitch <= 0 or pitch % item or pitch // item < size:
        return None
    storage = first.untyped_storage().data_ptr()
    for i, t in enumerate(targets):
        if (
            t.numel() != size
            or t.dtype != first.dtype
            or t.data_ptr() != first.data_ptr() + i * pitch
            or t.untyped_storage().data_ptr() != storage
        ):
            return None
    return first.as_strided((len(targets), size), (pitch // item, 1))


class _Plan:
    """For one layout and word grouping: per run, one stacked destination view (`stacked_view`) or
    the destination word views of its members (per word, in the order the runs list them), and the
    names that go through the typed path instead."""

    def __init__(self, dest: Mapping[str, Tensor], wire: WireState, groups: list[WordRun]) -> None:
        self.dest_words: dict[torch.dtype, list[Tensor]] = {}
        self.fast_runs: list[bool] = []
        self.stacked: list[Tensor | None] = []
        fast: set[str] = set()
        for run in groups:
            targets = [self._target(dest, wire, name, run.word) for name in run.names]
            ok = all(t is not None for t in targets)
            self.fast_runs.append(ok)
            whole = stacked_view(targets) if ok else None  # type: ignore[arg-type]
            self.stacked.append(whole)
            if ok and whole is None:
                self.dest_words.setdefault(run.word, []).extend(targets)  # type: ignore[arg-type]
            if ok:
                fast.update(run.names)
        self.typed = [name for name in wire if name not in fast]

    @staticmethod
    def _target(dest: Mapping[str, Tensor], wire: WireState, name: str, word: torch.dtype) -> Tensor | None:
        held, src = dest[name], wire[name]
        if held.dtype != src.dtype or held.shape != src.shape or held.device != src.device:
            return None
        return _word_view(held, word)


class WireCopier:
    """Copies wire state dicts into `dest` (name -> preallocated tensor, the same names, dtypes and
    shapes; fixed for the copier's life): `WireState`s as integer words (see the module doc), with
    the destination views of the last layout kept."""

    def __init__(self, dest: Mapping[str, Tensor]) -> None:
        self._dest = dest
        self._plan: tuple[object, _Plan] | None = None

    def copy(self, wire: Mapping[str, Tensor]) -> None:
        """Copy every tensor of `wire` into the destination of its name (all or nothing is the
        caller's: `wire` is verified before this runs). `wire` must hold exactly the destination's
        names (checked when a layout is new, or on every call for a mapping other than a
        `WireState`), else `KeyError`."""
        if not isinstance(wire, WireState):
            self._check_names(wire)
            copy_typed(self._dest, wire, list(wire))
            return
        groups = wire.word_runs()
        key = (wire.layout, tuple((run.word, run.names) for run in groups))
        if self._plan is None or self._plan[0] != key:
            self._plan = None
            self._check_names(wire)
            self._plan = (key, _Plan(self._dest, wire, groups))
        plan = self._plan[1]
        sources: dict[torch.dtype, list[Tensor]] = {}
        with torch.no_grad():
            for run, fast, whole in zip(groups, plan.fast_runs, plan.stacked):
                if whole is not None:
                    whole.copy_(run.whole)  # a run into a stacked destination: one copy
                elif fast:
                    sources.setdefault(run.word, []).extend(run.views)
            for word, dsts in plan.dest_words.items():
                torch._foreach_copy_(dsts, sources[word])
        if plan.typed:
            copy_typed(self._dest, wire, plan.typed)

    def _check_names(self, wire: Mapping[str, Tensor]) -> None:
        unknown = [name for name in wire if name not in self._dest]
        missing = [name for name in self._dest if name not in wire]
        if unknown or missing:
            raise KeyError(
                f"the wire state and the destination hold different names: missing {missing[:3]}"
                f"{' ...' if len(missing) > 3 else ''}, unknown {unknown[:3]}{' ...' if len(unknown) > 3 else ''}"
            )


def copy_typed(dest: Mapping[str, Tensor], wire: Mapping[str, Tensor], names: Sequence[str]) -> None:
    """`dest[n].copy_(wire[n])` for every name: one multi-tensor copy per (device, dtype) pair of
    destination and source, single copies where shapes or layouts differ."""
    groups: dict[tuple, tuple[list[Tensor], list[Tensor]]] = {}
    key_of: Callable[[Tensor, Tensor], tuple] = lambda d, s: (d.device, d.dtype, s.device, s.dtype)  # noqa: E731
    with torch.no_grad():
        for name in names:
            d, s = dest[name], wire[name]
            if d.device != s.device or d.shape != s.shape:
                d.copy_(s)
                continue
            ds, ss = groups.setdefault(key_of(d, s), ([], []))
            ds.append(d)
            ss.append(s)
        for ds, ss in groups.values():
            torch._foreach_copy_(ds, ss)
