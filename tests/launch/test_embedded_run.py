"""The embedded run end to end: real Ray actors, the real gloo sync, the real trainer and engine.

One local Ray cluster serves the module. The runs land in one sweep-like directory, so the report
is tested on real runs too.
"""

from __future__ import annotations

import json
import re
import time
import uuid

import pytest
import ray

from skyq.launch import loop as embedded
from skyq.launch.checkpointing import latest_checkpoint
from skyq.launch.metrics import read_metrics
from skyq.launch.ray_local import local_ray
from skyq.launch.rundir import CONFIG_JSON, CONFIG_YAML, LOCK_FILE, METRICS_FILE, PLOT_FILE
from skyq.report import write_report
from skyq.sync.errors import SyncError

from .run_helpers import run

STEP_KEYS = {
    "step", "weight_version", "reward", "response_length", "loss", "grad_norm", "lr",
    "mismatch/mean_abs_dlogp", "mismatch/k3_kl", "mismatch/max_abs_dlogp",
    "sync/bytes", "sync/gather_s", "sync/quantize_s", "sync/transfer_s", "sync/load_s", "sync/total_s",
    "time/step_s",
}  # fmt: skip
DEFAULT_STEPS = 24
FIRST_LAST = 8


@pytest.fixture(scope="module", autouse=True)
def cluster():
    with local_ray():  # the run's own loopback cluster, kept for the module
        yield


@pytest.fixture(scope="module")
def sweep_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("multirun")


@pytest.fixture(scope="module")
def default_run(sweep_dir, base_overrides):
    """The default precision (fp8_blockwise) for DEFAULT_STEPS steps."""
    overrides = [*base_overrides, f"algorithm.num_steps={DEFAULT_STEPS}", "checkpoint.save_interval=8"]
    return run(overrides, sweep_dir / "1-fp8_blockwise")


@pytest.fixture(scope="module")
def secret():
    return f"skyq-test-secret-{uuid.uuid4().hex}"


@pytest.fixture(scope="module")
def bf16_run(sweep_dir, base_overrides, secret):
    """bf16 for three steps, logging to wandb (offline) with a secret in the environment and the config."""
    mp = pytest.MonkeyPatch()
    mp.setenv("WANDB_API_KEY", secret)
    try:
        return run(
            [*base_overrides, "precision=bf16", "algorithm.num_steps=3", "logger=wandb",
             "logger.progress_bar=false", f"+trainer.env.WANDB_API_KEY={secret}"],
            sweep_dir / "0-bf16",
        )  # fmt: skip
    finally:
        mp.undo()


@pytest.fixture(scope="module")
def mxfp8_run(sweep_dir, base_overrides):
    return run([*base_overrides, "precision=mxfp8", "algorithm.num_steps=3"], sweep_dir / "2-mxfp8")


@pytest.fixture(scope="module")
def int4_killed_and_resumed(sweep_dir, base_overrides):
    """int4_qat with checkpoints every 2 steps; its engine actor is killed at the start of step 3,
    then the run is resumed to 6 steps. Returns (rows before the resume, seconds the failing sync
    took, the resume's RunResult)."""
    timeout_s = 5.0
    overrides = [*base_overrides, "precision=int4_qat", "checkpoint.save_interval=2",
                 f"rollout.weight_sync.timeout_s={timeout_s}", "algorithm.num_steps=6"]  # fmt: skip
    run_dir = sweep_dir / "3-int4_qat"
    real_run_step = embedded.run_step
    failed_after: list[float] = []

    def kill_engine_at_step_3(pair, task, step, **kwargs):
        if step != 3:
            return real_run_step(pair, task, step, **kwargs)
        ray.kill(pair.engine)
        start = time.monotonic()
        try:
            return real_run_step(pair, task, step, **kwargs)
        finally:
            failed_after.append(time.monotonic() - start)

    mp = pytest.MonkeyPatch()
    mp.setattr(embedded, "run_step", kill_engine_at_step_3)
    try:
        with pytest.raises(SyncError, match="weight sync of version 4 failed") as failure:
            run(overrides, run_dir)
    finally:
        mp.undo()
    assert failed_after[0] < timeout_s + 10, f"the failing sync took {failed_after[0]:.1f} s"
    assert re.search(r"engine: (ActorDiedError|RayActorError)", str(failure.value)), failure.value
    before = read_metrics(run_dir / METRICS_FILE)
    return before, failed_after[0], run(overrides, run_dir, resume=True)


def test_default_run_improves_reward_and_writes_its_run_dir(default_run):
    run_dir = default_run.run_dir
    rows = read_metrics(run_dir / METRICS_FILE)
    assert [r["step"] for r in rows] == list(range(DEFAULT_STEPS))
    assert [r["weight_version"] for r in rows] == [s + 1 for s in range(DEFAULT_STEPS)]
    assert all(STEP_KEYS <= set(r) for r in rows)
    rewards = [r["reward"] for r in rows]
    first = sum(rewards[:FIRST_LAST]) / FIRST_LAST
    last = sum(rewards[-FIRST_LAST:]) / FIRST_LAST
    assert last > first + 0.05, (first, last)
    assert default_run.reward_last == pytest.approx(sum(rewards[-10:]) / 10)
    assert len({r["sync/bytes"] for r in rows}) == 1 and rows[0]["sync/bytes"] > 0
    assert all(r[f"sync/{p}_s"] >= 0 for r in rows for p in ("gather", "quantize", "transfer", "load"))
    # >= 0: the bf16 trainer computes the engine's function, so a step can match it exactly
    assert all(0 <= r["mismatch/mean_abs_dlogp"] < 0.5 for r in rows)
    assert (run_dir / PLOT_FILE).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    saved = json.loads((run_dir / CONFIG_JSON).read_text())
    assert saved["config"]["precision"]["name"] == "fp8_blockwise"
    assert saved["config"]["algorithm"]["num_steps"] == DEFAULT_STEPS
    assert "fp8_blockwise" in (run_dir / CONFIG_YAML).read_text()
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_000016", "step_000024"]
    _, state = latest_checkpoint(run_dir / "checkpoints")
    assert (state.next_step, state.weight_version) == (DEFAULT_STEPS, DEFAULT_STEPS + 1)
    assert not (run_dir / LOCK_FILE).exists()


@pytest.mark.parametrize("which", ["bf16", "mxfp8"])
def test_each_precision_runs_a_few_steps(request, which):
    result = request.getfixturevalue(f"{which}_run")
    rows = read_metrics(result.run_dir / METRICS_FILE)
    assert [r["weight_version"] for r in rows] == [1, 2, 3] and result.weight_version == 3
    assert all(0 <= r["reward"] <= 1 and r["sync/bytes"] > 0 for r in rows)


def test_killed_engine_fails_the_sync_within_its_deadline_and_resume_continues_identically(
    int4_killed_and_resumed,
):
    before, _, resumed = int4_killed_and_resumed
    # The killed run logged steps 0-2 and checkpointed after step 1 (next step 2, version 3).
    assert [r["step"] for r in before] == [0, 1, 2]
    run_dir = resumed.run_dir
    assert resumed.start_step == 2 and resumed.weight_version == 6
    rows = read_metrics(run_dir / METRICS_FILE)
    assert [(r["step"], r["weight_version"]) for r in rows] == [(s, s + 1) for s in range(6)]
    # Steps 0-1 are kept as logged; step 2 is redone from the checkpoint with the same data and
    # weights, so it reproduces the killed run's step 2 exactly.
    keys = ("weight_version", "reward", "response_length", "loss", "grad_norm", "mismatch/mean_abs_dlogp")
    for key in keys:
        assert [r[key] for r in rows[:3]] == [r[key] for r in before], key
    _, state = latest_checkpoint(run_dir / "checkpoints")
    assert (state.next_step, state.weight_version) == (6, 7)


def test_lower_precisions_send_fewer_bytes_than_bf16(
    bf16_run, mxfp8_run, default_run, int4_killed_and_resumed
):
    def sync_bytes(result):
        return read_metrics(result.run_dir / METRICS_FILE)[0]["sync/bytes"]

    bf16 = sync_bytes(bf16_run)
    assert sync_bytes(default_run) < bf16
    assert sync_bytes(mxfp8_run) < bf16
    assert sync_bytes(int4_killed_and_resumed[2]) < bf16


def test_env_secrets_never_reach_the_run_dir(bf16_run, secret):
    run_dir = bf16_run.run_dir
    assert (run_dir / "wandb").is_dir(), "the bf16 run logs to wandb (offline)"
    files = [p for p in run_dir.rglob("*") if p.is_file()]
    assert files
    leaked = [str(p) for p in files if secret.encode() in p.read_bytes()]
    assert leaked == []
    saved = json.loads((run_dir / CONFIG_JSON).read_text())
    assert saved["config"]["trainer"]["env"]["WANDB_API_KEY"].startswith("<redacted")


def test_report_compares_the_sweep_against_bf16(
    sweep_dir, default_run, bf16_run, mxfp8_run, int4_killed_and_resumed
):
    table = write_report(sweep_dir)
    lines = table.strip().splitlines()
    assert len(lines) == 2 + 4
    assert [line.split("|")[2].strip() for line in lines[2:]] == [
        "bf16",
        "fp8_blockwise",
        "mxfp8",
        "int4_qat",
    ]
    assert "| 1.00x |" in lines[2]  # bf16 against itself
    assert (sweep_dir / "report.md").read_text().endswith(table)
    assert (sweep_dir / "report.png").read_bytes()[:4] == b"\x89PNG"
