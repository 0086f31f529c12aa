"""Crash-safe run checkpoints: trainer state (weights, optimizer, RNG) plus the run's position.

    <root>/step_000020/trainer.pt      written by the trainer actor (torch.save; read weights_only)
    <root>/step_000020/run_state.json  next step, weight version, seed, sha256 of trainer.pt

A checkpoint is assembled in a hidden temp directory, every file fsynced, then renamed into place,
so a `step_*` directory is always complete; a kill at any moment leaves the previous one intact.
The newest verified one is what a resume continues from. The last `KEEP` are kept.

A save is either synchronous (`save_run_checkpoint`) or split in three around a trainer that writes
trainer.pt in the background (`begin_run_checkpoint` -> the trainer writes -> `finish_run_checkpoint`,
or `abort_run_checkpoint` if the write failed); until it is finished only the temp directory exists.
The background writer finishes the checkpoint itself as soon as trainer.pt is on disk
(`PendingCheckpoint`), not when the driver next looks.

Versions: the weights saved after step s (s+1 updates) are weight version s+2 — the version the
next step syncs before its rollouts — so a resume re-syncs the engine at the saved version first.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from skyq.checkpoint.atomic import atomic_write_json, fsync_dir

RUN_STATE = "run_state.json"
TRAINER_STATE = "trainer.pt"
STATE_FORMAT = "skyq-run-checkpoint/1"
KEEP = 2
_PREFIX = "step_"
_TEMP_PREFIX = ".tmp-step_"


class RunCheckpointError(ValueError):
    """A run checkpoint that is missing, damaged or does not belong to this run."""


@dataclass(frozen=True, slots=True)
class RunState:
    """Where a run stands at a checkpoint."""

    next_step: int
    """The first step a resume runs (= steps completed); also the data position."""
    weight_version: int
    """Version of the saved weights: synced before `next_step`'s rollouts (= next_step + 1)."""
    seed: int
    trainer_sha256: str
    """Digest of trainer.pt, checked before it is loaded."""


@dataclass(frozen=True, slots=True)
class PendingCheckpoint:
    """A checkpoint begun by `begin_run_checkpoint` (its temp dir `tmp`) and what finishing it needs.

    The trainer of an asynchronous save finishes it itself the moment trainer.pt is written
    (`TrainerWorker.start_save_state`), so a save is usable as soon as it is complete."""

    root: Path
    tmp: Path
    next_step: int
    seed: int

    @property
    def trainer_path(self) -> Path:
        return self.tmp / TRAINER_STATE

    def finish(self, trainer_sha256: str) -> Path:
        """`finish_run_checkpoint` of this checkpoint; returns its final directory."""
        return finish_run_checkpoint(
            self.root, self.tmp, next_step=self.next_step, seed=self.seed, trainer_sha256=trainer_sha256
        )

    def abort(self) -> None:
        abort_run_checkpoint(self.tmp)


def checkpoint_root(run_dir: Path, save: str | None) -> Path:
    """`checkpoint.save` if set, else `<run dir>/checkpoints`."""
    return Path(save).expanduser().resolve() if save else run_dir / "checkpoints"


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def begin_run_checkpoint(root: Path, next_step: int) -> Path:
    """The hidden temp directory a checkpoint for `next_step` is assembled in (trainer.pt goes there).

    Removes temp directories left by a run killed mid-save; only one save is in flight at a time, so
    none of them can still be in use."""
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(f"{_TEMP_PREFIX}*"):
        shutil.rmtree(stale, ignore_errors=True)
    tmp = root / f"{_TEMP_PREFIX}{next_step:06d}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    return tmp


def abort_run_checkpoint(tmp: Path) -> None:
    """Drop a checkpoint that will not be finished; the previous ones stay as they are."""
    shutil.rmtree(tmp, ignore_errors=True)


def finish_run_checkpoint(root: Path, tmp: Path, *, next_step: int, seed: int, trainer_sha256: str) -> Path:
    """Complete the checkpoint in `tmp` (trainer.pt written, `trainer_sha256` its digest as written):
    check the bytes on disk, write run_state.json, rename into place, keep the last `KEEP`."""
    try:
        if sha256_file(tmp / TRAINER_STATE) != trainer_sha256:  # read back what is on disk before trusting it
            raise RunCheckpointError(
                f"{tmp / TRAINER_STATE}: bytes on disk differ from what the trainer wrote"
            )
        state = RunState(
            next_step=next_step, weight_version=next_step + 1, seed=seed, trainer_sha256=trainer_sha256
        )
        atomic_write_json(tmp / RUN_STATE, {"format": STATE_FORMAT, **asdict(state)})
        fsync_dir(tmp)
        final = root / f"{_PREFIX}{next_step:06d}"
        if final.exists():  # a resumed run re-reaching a step it had saved before being killed
            shutil.rmtree(final)
        tmp.rename(final)
        fsync_dir(root)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    for old in _step_dirs(root)[:-KEEP]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def save_run_checkpoint(
    root: Path, *, next_step: int, seed: int, write_trainer: Callable[[Path], str]
) -> Path:
    """Write a checkpoint for `next_step`; `write_trainer(path)` writes trainer.pt durably and returns its sha256."""
    tmp = begin_run_checkpoint(root, next_step)
    try:
        sha = write_trainer(tmp / TRAINER_STATE)
    except BaseException:
        abort_run_checkpoint(tmp)
        raise
    return finish_run_checkpoint(root, tmp, next_step=next_step, seed=seed, trainer_sha256=sha)


def _step_dirs(root: Path) -> list[Path]:
    dirs = [p for p in root.glob(f"{_PREFIX}*") if p.is_dir() and p.name[len(_PREFIX) :].isdigit()]
    return sorted(dirs, key=lambda p: int(p.name[len(_PREFIX) :]))


def read_run_state(checkpoint_dir: Path) -> RunState:
    """The verified run state of one checkpoint directory."""
    path = checkpoint_dir / RUN_STATE
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise RunCheckpointError(f"{path}: unreadable run state ({exc})") from None
    fields = {"format", "next_step", "weight_version", "seed", "trainer_sha256"}
    if not isinstance(raw, dict) or set(raw) != fields or raw["format"] != STATE_FORMAT:
        raise RunCheckpointError(f"{path}: not a {STATE_FORMAT} file")
    state = RunState(**{k: raw[k] for k in fields - {"format"}})
    if state.weight_version != state.next_step + 1:
        raise RunCheckpointError(
            f"{path}: weight_version {state.weight_version} != next_step + 1 = {state.next_step + 1}"
        )
    got = sha256_file(checkpoint_dir / TRAINER_STATE)
    if got != state.trainer_sha256:
        raise RunCheckpointError(
            f"{checkpoint_dir / TRAINER_STATE}: sha256 {got} != {state.trainer_sha256} recorded at save; the file is damaged"
        )
    return state


def latest_checkpoint(root: Path) -> tuple[Path, RunState]:
    """The newest complete checkpoint under `root`; a damaged newest one is an error, not skipped."""
    dirs = _step_dirs(root) if root.is_dir() else []
    if not dirs:
        raise RunCheckpointError(
            f"no checkpoint under {root}: the run was killed before its first save "
            "(checkpoint.save_interval); start it again instead of resuming"
        )
    return dirs[-1], read_run_state(dirs[-1])
