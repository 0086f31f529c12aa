"""The mismatch guard: a run whose engine stops sampling the trainer's policy ends loudly.

The failure injected here is the one the guard exists for: an engine that accepts every weight push
after the first (version advances, accounting passes) and applies none. The first sync is checked bit
for bit, so only the mismatch can show it; the guard turns it into an error within `mismatch_patience`
steps instead of a run that trains on off-policy samples. The engine is the real `EmbeddedEngine`
with its `load_weights` replaced for the injection (in-process placement, so the patch reaches it).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from skyq.config.validate import ConfigValidationError, validate
from skyq.launch.checkpointing import checkpoint_root
from skyq.launch.guards import MismatchError, MismatchGuard
from skyq.launch.rundir import METRICS_FILE
from skyq.rollout.embedded import EmbeddedEngine

from .run_helpers import compose_config, run

IN_PROCESS = "rollout.weight_sync.transport=in_process"


def test_guard_trips_after_patience_consecutive_steps_and_resets_on_a_good_one():
    guard = MismatchGuard(0.1, 3)
    for step, value in enumerate([0.2, 0.3, 0.01, 0.2, 0.5]):
        guard.observe(step, value)  # never three in a row
    with pytest.raises(MismatchError, match="max_mismatch=0.1 for 3 consecutive steps") as info:
        guard.observe(5, 0.4)
    assert "step 3: 0.2, step 4: 0.5, step 5: 0.4" in str(info.value)


def test_non_finite_mismatch_counts_as_over_and_zero_limit_is_off():
    guard = MismatchGuard(0.5, 1)
    with pytest.raises(MismatchError, match="step 7: nan"):
        guard.observe(7, math.nan)
    off = MismatchGuard(0.0, 1)
    for step in range(5):
        off.observe(step, 100.0)


@pytest.mark.parametrize("override", ["algorithm.max_mismatch=-1", "algorithm.mismatch_patience=0"])
def test_bad_guard_settings_are_refused_naming_the_keys(override):
    cfg, _ = compose_config([override])
    with pytest.raises(ConfigValidationError, match="algorithm.max_mismatch=.*mismatch_patience="):
        validate(cfg)


def test_an_engine_that_drops_weight_pushes_stops_the_run(base_overrides, tmp_path, monkeypatch):
    applied = EmbeddedEngine.load_weights

    def drop_after_first(self, wire, version):
        if self._version < 1:  # the first push (checked bit for bit) goes through
            return applied(self, wire, version)
        self._version = version  # accepts the push and applies nothing

    monkeypatch.setattr(EmbeddedEngine, "load_weights", drop_after_first)
    run_dir = tmp_path / "run"
    # Measured here: 0 at step 0 (the checked push), then 0.57-2.2 from step 1; a limit of 0.2 keeps the
    # test off the exact values (which move with the CPU's kernels) while a healthy run sits at ~0.
    overrides = [*base_overrides, IN_PROCESS, "algorithm.num_steps=12", "checkpoint.save_interval=6",
                 "algorithm.max_mismatch=0.2"]  # fmt: skip
    with pytest.raises(MismatchError, match=r"above algorithm.max_mismatch=0.2 for 3 consecutive") as info:
        run(overrides, run_dir)
    assert "weight sync" in str(info.value)
    rows = [json.loads(line) for line in (run_dir / METRICS_FILE).read_text().splitlines()]
    mismatch = [r["mismatch/mean_abs_dlogp"] for r in rows]
    assert mismatch[0] < 0.05  # the first push is applied (and checked bit for bit)
    assert 4 <= len(rows) <= 6 and all(m > 0.2 for m in mismatch[-3:])  # third bad step in a row
    assert f"step {rows[-1]['step']}: " in str(info.value)  # the rows up to the stop are kept
    assert not checkpoint_root(run_dir, None).exists()  # no checkpoint of the broken state (interval 6)


def test_train_exits_1_and_says_why_when_the_guard_trips(tmp_path, cache_dir):
    """The CLI path: an fp32 trainer has a small nonzero mismatch, so a limit of 1e-12 trips at once."""
    out = subprocess.run(
        [sys.executable, "-m", "skyq.train", IN_PROCESS, "trainer.compute_dtype=fp32", "algorithm.num_steps=4",
         "algorithm.max_mismatch=1e-12", "algorithm.mismatch_patience=1", "algorithm.global_batch_size=32",
         "logger.progress_bar=false", f"checkpoint.cache_dir={cache_dir}", f"output_root={tmp_path}"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 1, out.stderr[-2000:]
    assert "stopped: train/rollout mismatch" in out.stderr and "algorithm.max_mismatch=1e-12" in out.stderr
