"""metrics.jsonl survives a kill mid-write, and a resume drops the steps it will redo."""

from __future__ import annotations

import json

import pytest

from skyq.config.schema import LoggerConfig
from skyq.launch.metrics import MetricsLogger, keep_rows_before, read_metrics


def row(step):
    return {
        "step": step,
        "reward": 0.5,
        "mismatch/mean_abs_dlogp": 0.01,
        "sync/bytes": 10,
        "loss": float("nan"),
    }


def test_rows_are_written_per_step_and_non_finite_values_stay_visible(tmp_path):
    path = tmp_path / "metrics.jsonl"
    with MetricsLogger(path, logger_cfg=LoggerConfig(progress_bar=False), wandb_config={}, run_name="r",
                       num_steps=3, start_step=0) as metrics:  # fmt: skip
        metrics.log(row(0))
        assert [r["step"] for r in read_metrics(path)] == [0]  # on disk before the next step
        metrics.log(row(1))
    assert read_metrics(path)[1]["loss"] == "nan"


def test_a_torn_last_line_is_dropped_and_a_resume_truncates(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(row(s)) + "\n" for s in range(5)) + '{"step": 5, "rew')
    assert [r["step"] for r in read_metrics(path)] == [0, 1, 2, 3, 4]
    keep_rows_before(path, 3)
    assert [r["step"] for r in read_metrics(path)] == [0, 1, 2]


def test_a_damaged_middle_line_is_an_error(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0}\nnot json\n{"step": 2}\n')
    with pytest.raises(ValueError, match="metrics.jsonl:2"):
        read_metrics(path)
