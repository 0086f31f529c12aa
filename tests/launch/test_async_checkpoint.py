"""Asynchronous run checkpoints (`checkpoint.async_save`, the default): the trainer snapshots its state
at the save step and writes trainer.pt on a background thread while the run goes on, and commits the
checkpoint as soon as the file is written. Same files as a synchronous save, a failed
write stops the run naming the file, and a kill mid-write leaves the previous checkpoint in charge."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from skyq.launch import actors, loop, pair
from skyq.launch.checkpointing import TRAINER_STATE, RunCheckpointError, latest_checkpoint
from skyq.launch.metrics import read_metrics
from skyq.launch.ray_local import local_ray
from skyq.launch.rundir import METRICS_FILE

from .run_helpers import run

IN_PROCESS = "rollout.weight_sync.transport=in_process"
STEPS = ["algorithm.num_steps=4", "checkpoint.save_interval=2"]
SAVED = ["step_000002", "step_000004"]


def trainer_bytes(run_dir: Path) -> dict[str, bytes]:
    root = run_dir / "checkpoints"
    return {p.name: (p / TRAINER_STATE).read_bytes() for p in sorted(root.iterdir())}


def loaded(run_dir: Path, name: str) -> dict:
    return torch.load(run_dir / "checkpoints" / name / TRAINER_STATE, weights_only=True)


def flat(obj, prefix: str = "") -> dict[str, object]:
    """Every leaf of a loaded state by path; tensors as (dtype, shape, bytes) so == compares bits."""
    if isinstance(obj, dict):
        return {k: v for key, item in obj.items() for k, v in flat(item, f"{prefix}/{key}").items()}
    if isinstance(obj, (list, tuple)):
        return {k: v for i, item in enumerate(obj) for k, v in flat(item, f"{prefix}/{i}").items()}
    if isinstance(obj, torch.Tensor):
        t = obj.detach().reshape(-1).contiguous()
        return {prefix: (t.dtype, tuple(obj.shape), t.view(torch.uint8).numpy().tobytes())}
    return {prefix: obj}


def untimed(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.endswith("_s")} for r in rows]


@pytest.fixture(scope="module")
def sync_run(tmp_path_factory, base_overrides) -> Path:
    """The reference: 4 in-process steps with synchronous saves after steps 1 and 3."""
    run_dir = tmp_path_factory.mktemp("sync") / "run"
    run([*base_overrides, IN_PROCESS, *STEPS, "checkpoint.async_save=false"], run_dir)
    return run_dir


@pytest.fixture(scope="module")
def async_run(tmp_path_factory, base_overrides) -> tuple[Path, list[int]]:
    """The same run with background saves, each write held back until the trainer has taken its next
    step (so training after the save step would show in the file if the snapshot leaked). Returns the
    run dir and the trainer step seen by each write when it began."""
    run_dir = tmp_path_factory.mktemp("async") / "run"
    updates = threading.Semaphore(0)
    real_train_step, real_write = actors.TrainerWorker.train_step, actors.write_trainer_state
    seen_at_write: list[int] = []
    workers: list[actors.TrainerWorker] = []

    def train_step(self, batch):
        workers[:] = [self]
        try:
            return real_train_step(self, batch)
        finally:
            updates.release()

    def slow_write(path, state):
        saved_step = state["trainer"]["step"]
        if saved_step < 4:  # not the run's last save: wait until the next update has been applied
            while workers[0].trainer.step <= saved_step:
                assert updates.acquire(timeout=120), "the run did not go on while the checkpoint was written"
        seen_at_write.append(workers[0].trainer.step)
        return real_write(path, state)

    mp = pytest.MonkeyPatch()
    mp.setattr(actors.TrainerWorker, "train_step", train_step)
    mp.setattr(actors, "write_trainer_state", slow_write)
    try:
        run([*base_overrides, IN_PROCESS, *STEPS], run_dir)
    finally:
        mp.undo()
    return run_dir, seen_at_write


def test_async_and_sync_saves_write_the_same_bytes_snapshotted_at_the_save_step(sync_run, async_run):
    async_dir, seen_at_write = async_run
    # The first write began after the trainer had moved past the save (step 2 saved, trainer at 3+).
    assert seen_at_write[0] > 2 and seen_at_write[1] == 4
    sync_files, async_files = trainer_bytes(sync_run), trainer_bytes(async_dir)
    assert sorted(sync_files) == sorted(async_files) == SAVED
    for name in SAVED:
        assert async_files[name] == sync_files[name], f"{name}/trainer.pt differs between sync and async"
    state = torch.load(async_dir / "checkpoints" / "step_000002" / TRAINER_STATE, weights_only=True)
    assert state["trainer"]["step"] == 2
    assert untimed(read_metrics(async_dir / METRICS_FILE)) == untimed(read_metrics(sync_run / METRICS_FILE))
    assert not [p for p in (async_dir / "checkpoints").iterdir() if p.name.startswith(".")]


def test_an_async_save_is_committed_before_the_next_save_begins(
    tmp_path, base_overrides, monkeypatch, capsys
):
    """The step-2 checkpoint is in place while step 2 runs, without waiting for the next save (at
    the run's end here): a run killed before then resumes from it."""
    root = tmp_path / "run" / "checkpoints"
    real_run_step = loop.run_step
    seen: list[list[str]] = []

    def run_step(pair, task, step, **kwargs):
        if step == 2:
            deadline = time.monotonic() + 60
            while not (root / "step_000002").is_dir() and time.monotonic() < deadline:
                time.sleep(0.05)
            seen.append(sorted(p.name for p in root.iterdir()))
        return real_run_step(pair, task, step, **kwargs)

    monkeypatch.setattr(loop, "run_step", run_step)
    run(
        [*base_overrides, IN_PROCESS, "algorithm.num_steps=3", "checkpoint.save_interval=2"], tmp_path / "run"
    )
    assert seen == [["step_000002"]]
    assert latest_checkpoint(root)[1].next_step == 3
    # Start-up said what it was doing, one line per phase.
    startup = [line for line in capsys.readouterr().out.splitlines() if line.startswith("start-up: ")]
    assert [line.split(" (")[0].split(" after ")[0] for line in startup] == [
        "start-up: locating the starting checkpoint",
        "start-up: building the trainer and the engine in this process",
        "start-up: trainer and engine ready",
    ]


def test_a_failed_background_write_stops_the_run_naming_the_file(tmp_path, base_overrides, monkeypatch):
    real_write = actors.write_trainer_state

    def disk_full_at_step_4(path, state):
        if state["trainer"]["step"] == 4:
            raise OSError(28, "No space left on device")
        return real_write(path, state)

    monkeypatch.setattr(actors, "write_trainer_state", disk_full_at_step_4)
    run_dir = tmp_path / "run"
    overrides = [*base_overrides, IN_PROCESS, "algorithm.num_steps=5", "checkpoint.save_interval=2"]
    with pytest.raises(RunCheckpointError) as failure:
        run(overrides, run_dir)
    message = str(failure.value)
    assert "checkpoint of step 4 was not saved" in message
    assert ".tmp-step_000004-" in message and "trainer.pt" in message
    assert "No space left on device" in message
    # raised at the next save (the run's last step), not swallowed; no step 5 checkpoint was begun
    assert [r["step"] for r in read_metrics(run_dir / METRICS_FILE)] == [0, 1, 2, 3, 4]
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == ["step_000002"]
    assert latest_checkpoint(run_dir / "checkpoints")[1].next_step == 2


@pytest.fixture(scope="module")
def ray_cluster():
    with local_ray():
        yield


def test_a_failed_write_in_the_trainer_actor_is_raised_by_the_driver(
    tmp_path, base_overrides, monkeypatch, ray_cluster
):
    """Ray actor placement (the CPU default): the actor's thread fails; the driver's wait says why."""
    real_begin = pair.begin_run_checkpoint

    def begin_with_a_blocked_target(root, next_step):
        tmp = real_begin(root, next_step)
        if next_step == 4:  # trainer.pt cannot be renamed over a non-empty directory
            (tmp / TRAINER_STATE).mkdir()
            (tmp / TRAINER_STATE / "in-the-way").write_bytes(b"")
        return tmp

    monkeypatch.setattr(pair, "begin_run_checkpoint", begin_with_a_blocked_target)
    run_dir = tmp_path / "run"
    with pytest.raises(RunCheckpointError) as failure:
        run([*base_overrides, *STEPS], run_dir)
    message = str(failure.value)
    assert message.startswith("the checkpoint of step 4 was not saved: RunCheckpointError: ")
    assert "trainer.pt: writing the trainer state in the background failed" in message
    assert "ray::" not in message  # the actor's own error, not Ray's wrapper
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == ["step_000002"]
    assert latest_checkpoint(run_dir / "checkpoints")[1].next_step == 2


def test_ray_actor_async_saves_match_the_synchronous_in_process_files(
    tmp_path, base_overrides, sync_run, ray_cluster
):
    run_dir = tmp_path / "run"
    run([*base_overrides, *STEPS], run_dir)
    _, state = latest_checkpoint(run_dir / "checkpoints")
    assert state.next_step == 4
    assert untimed(read_metrics(run_dir / METRICS_FILE)) == untimed(read_metrics(sync_run / METRICS_FILE))
    # Same weights, optimizer and step; the RNG differs only because the engine shares the
    # trainer's process (and its global generator) in the in-process run.
    for name in SAVED:
        assert flat(loaded(run_dir, name)["trainer"]) == flat(loaded(sync_run, name)["trainer"])


KILLED_MID_WRITE = textwrap.dedent(
    """
    import os, signal, sys
    from pathlib import Path

    from launch.run_helpers import run
    from skyq.launch import actors

    real_write = actors.write_trainer_state

    def killed_mid_write(path, state):
        if state["trainer"]["step"] == 4:  # the process dies with half a temp file written
            (path.parent / ".trainer.pt.skyq-tmp-killed").write_bytes(b"PK\\x03\\x04 half a zip")
            os.kill(os.getpid(), signal.SIGKILL)
        return real_write(path, state)

    actors.write_trainer_state = killed_mid_write
    run(sys.argv[2:], Path(sys.argv[1]))
    """
)


def test_a_kill_during_the_background_write_resumes_from_the_previous_checkpoint(
    tmp_path, base_overrides, async_run
):
    """SIGKILL while the step-4 trainer.pt is being written: only its hidden temp dir is left, the
    resume continues from step 2, removes the temp dir and writes the same step-4 state as a run
    that was never killed."""
    run_dir = tmp_path / "run"
    overrides = [*base_overrides, IN_PROCESS, *STEPS]
    tests_dir = Path(__file__).resolve().parents[1]
    killed = subprocess.run(
        [sys.executable, "-c", KILLED_MID_WRITE, str(run_dir), *overrides],
        cwd=tests_dir.parent,
        env={**os.environ, "PYTHONPATH": str(tests_dir)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert killed.returncode == -9, killed.stderr[-3000:]
    root = run_dir / "checkpoints"
    left = sorted(p.name for p in root.iterdir())
    assert left[0].startswith(".tmp-step_000004-") and left[1:] == ["step_000002"], left
    assert latest_checkpoint(root)[1].next_step == 2
    resumed = run(overrides, run_dir, resume=True)
    assert (resumed.start_step, resumed.weight_version) == (2, 4)
    assert sorted(p.name for p in root.iterdir()) == SAVED
    for name in SAVED:  # the loaded state (weights, optimizer, step, RNG) of a never-killed run
        assert flat(loaded(run_dir, name)) == flat(loaded(async_run[0], name))
