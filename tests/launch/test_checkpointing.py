"""Run checkpoints are complete or absent, verified before use, and only the last two are kept."""

from __future__ import annotations

import hashlib
import io

import pytest
import torch

from skyq.launch.actors import _BackgroundSave, write_trainer_state
from skyq.launch.checkpointing import (
    RUN_STATE,
    TRAINER_STATE,
    PendingCheckpoint,
    RunCheckpointError,
    abort_run_checkpoint,
    begin_run_checkpoint,
    finish_run_checkpoint,
    latest_checkpoint,
    save_run_checkpoint,
    sha256_file,
)


def fake_trainer(payload: bytes):
    def write(path):
        path.write_bytes(payload)
        return hashlib.sha256(payload).hexdigest()

    return write


def test_latest_checkpoint_is_the_newest_and_only_two_are_kept(tmp_path):
    for step in (2, 4, 6):
        save_run_checkpoint(tmp_path, next_step=step, seed=7, write_trainer=fake_trainer(f"w{step}".encode()))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000004", "step_000006"]
    path, state = latest_checkpoint(tmp_path)
    assert path.name == "step_000006"
    assert (state.next_step, state.weight_version, state.seed) == (6, 7, 7)
    assert (path / TRAINER_STATE).read_bytes() == b"w6"


def test_a_save_killed_midway_leaves_the_previous_checkpoint_in_charge(tmp_path):
    save_run_checkpoint(tmp_path, next_step=2, seed=0, write_trainer=fake_trainer(b"good"))

    def dies(path):
        path.write_bytes(b"half")
        raise KeyboardInterrupt  # the process is being killed while writing

    with pytest.raises(KeyboardInterrupt):
        save_run_checkpoint(tmp_path, next_step=4, seed=0, write_trainer=dies)
    assert [p.name for p in tmp_path.iterdir()] == ["step_000002"]
    assert latest_checkpoint(tmp_path)[1].next_step == 2
    # A temp dir left by a SIGKILL (no cleanup ran) is ignored, then removed by the next save.
    (tmp_path / ".tmp-step_000004-deadbeef").mkdir()
    assert latest_checkpoint(tmp_path)[1].next_step == 2
    save_run_checkpoint(tmp_path, next_step=4, seed=0, write_trainer=fake_trainer(b"next"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000002", "step_000004"]


def test_a_damaged_trainer_state_is_refused_naming_the_file(tmp_path):
    path = save_run_checkpoint(tmp_path, next_step=2, seed=0, write_trainer=fake_trainer(b"weights"))
    (path / TRAINER_STATE).write_bytes(b"weightz")
    with pytest.raises(RunCheckpointError, match=r"step_000002/trainer\.pt: sha256 .* damaged"):
        latest_checkpoint(tmp_path)


def test_a_trainer_that_misreports_its_bytes_fails_the_save(tmp_path):
    def lies(path):
        path.write_bytes(b"abc")
        return hashlib.sha256(b"abd").hexdigest()

    with pytest.raises(RunCheckpointError, match="differ from what the trainer wrote"):
        save_run_checkpoint(tmp_path, next_step=2, seed=0, write_trainer=lies)
    assert list(tmp_path.iterdir()) == []


def test_no_checkpoint_gives_a_clear_error(tmp_path):
    with pytest.raises(RunCheckpointError, match="killed before its first save"):
        latest_checkpoint(tmp_path / "checkpoints")
    path = save_run_checkpoint(tmp_path, next_step=2, seed=0, write_trainer=fake_trainer(b"w"))
    (path / RUN_STATE).write_text('{"format": "other"}')
    with pytest.raises(RunCheckpointError, match="not a skyq-run-checkpoint/1 file"):
        latest_checkpoint(tmp_path)


def test_a_checkpoint_in_three_parts_is_invisible_until_finished(tmp_path):
    """The asynchronous save: begin (temp dir), the trainer writes in the background, finish."""
    save_run_checkpoint(tmp_path, next_step=2, seed=0, write_trainer=fake_trainer(b"two"))
    tmp = begin_run_checkpoint(tmp_path, 4)
    assert tmp.parent == tmp_path and tmp.name.startswith(".tmp-step_000004-")
    sha = fake_trainer(b"four")(tmp / TRAINER_STATE)
    assert latest_checkpoint(tmp_path)[1].next_step == 2  # a write in flight is not a checkpoint
    final = finish_run_checkpoint(tmp_path, tmp, next_step=4, seed=0, trainer_sha256=sha)
    assert final.name == "step_000004" and not tmp.exists()
    assert latest_checkpoint(tmp_path)[1].next_step == 4
    # A failed write is dropped; the checkpoints before it stay.
    tmp = begin_run_checkpoint(tmp_path, 6)
    abort_run_checkpoint(tmp)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000002", "step_000004"]
    # Finishing checks the bytes on disk against the digest taken while writing.
    tmp = begin_run_checkpoint(tmp_path, 6)
    (tmp / TRAINER_STATE).write_bytes(b"six")
    with pytest.raises(RunCheckpointError, match="differ from what the trainer wrote"):
        finish_run_checkpoint(
            tmp_path, tmp, next_step=6, seed=0, trainer_sha256=hashlib.sha256(b"sIx").hexdigest()
        )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000002", "step_000004"]


def test_trainer_state_is_hashed_as_it_is_written(tmp_path):
    state = {
        "trainer": {"w": torch.arange(6.0).reshape(2, 3), "step": 3},
        "rng": {"torch": torch.get_rng_state()},
    }
    sha = write_trainer_state(tmp_path / TRAINER_STATE, state)
    buffer = io.BytesIO()
    torch.save(state, buffer)  # what the synchronous save wrote before
    assert (tmp_path / TRAINER_STATE).read_bytes() == buffer.getvalue()
    assert sha == hashlib.sha256(buffer.getvalue()).hexdigest() == sha256_file(tmp_path / TRAINER_STATE)
    assert [p.name for p in tmp_path.iterdir()] == [TRAINER_STATE]  # no temp file left


def pending(root, next_step: int) -> PendingCheckpoint:
    return PendingCheckpoint(
        root=root, tmp=begin_run_checkpoint(root, next_step), next_step=next_step, seed=0
    )


def test_a_background_write_that_fails_names_the_file(tmp_path):
    gone = pending(tmp_path, 2)
    gone.tmp.rmdir()
    saving = _BackgroundSave(gone, {"w": torch.zeros(3)})
    with pytest.raises(
        RunCheckpointError,
        match=r"\.tmp-step_000002-\w+/trainer\.pt: writing the trainer state in the background failed: "
        "FileNotFoundError",
    ):
        saving.result()
    assert list(tmp_path.iterdir()) == []


def test_a_background_save_is_committed_as_soon_as_it_is_written(tmp_path):
    """Nobody waits for the save: once its thread has written trainer.pt the checkpoint is in place,
    so a run killed before its next save resumes from it."""
    saving = _BackgroundSave(pending(tmp_path, 2), {"w": torch.arange(3.0)})
    saving.thread.join()
    ckpt, state = latest_checkpoint(tmp_path)
    assert ckpt.name == "step_000002" and state.next_step == 2
    assert [p.name for p in tmp_path.iterdir()] == ["step_000002"]  # the temp dir became it
    assert torch.load(ckpt / TRAINER_STATE, weights_only=True)["w"].tolist() == [0.0, 1.0, 2.0]
    assert saving.result() == str(ckpt) and state.trainer_sha256 == sha256_file(ckpt / TRAINER_STATE)
