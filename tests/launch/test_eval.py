"""Evaluation in the embedded run (`task.eval.*`), through the real driver: Ray-free in-process sync,
the tiny model, the arith task's whole problem space."""

from __future__ import annotations

import json

from skyq.launch.rundir import METRICS_FILE

from .run_helpers import run

IN_PROCESS = "rollout.weight_sync.transport=in_process"


def _rows(run_dir):
    return [json.loads(line) for line in (run_dir / METRICS_FILE).read_text().splitlines()]


def test_eval_rows_at_the_interval_and_the_run_itself_unchanged(base_overrides, tmp_path):
    """Steps 0 and 2 of 4 carry eval/* (10 copy problems, 2 samples each at temperature 1); every
    training metric of every step equals a run without eval (eval draws from its own seed and only
    reads the weights)."""
    common = [*base_overrides, IN_PROCESS, "algorithm.num_steps=4", "checkpoint.save_interval=0"]
    run(common, tmp_path / "plain")
    run(
        [*common, "task.eval.interval=2", "task.eval.num_samples=2", "task.eval.temperature=1.0"],
        tmp_path / "eval",
    )
    plain, scored = _rows(tmp_path / "plain"), _rows(tmp_path / "eval")
    assert [sorted(k for k in r if k.startswith("eval/")) != [] for r in scored] == [True, False, True, False]
    for r in (scored[0], scored[2]):
        assert r["eval/prompts"] == 10.0
        assert 0.0 <= r["eval/reward"] <= r["eval/best_of_n"] <= 1.0
    for a, b in zip(plain, scored, strict=True):
        for key in ("reward", "loss", "grad_norm", "response_length", "mismatch/mean_abs_dlogp"):
            assert a[key] == b[key], (a["step"], key)


def test_greedy_eval_of_the_same_weights_gives_the_same_score(base_overrides, tmp_path):
    """temperature 0 is greedy: two runs from the same start evaluate step 0 identically, and the
    score is a whole number of the 10 problems."""
    overrides = [*base_overrides, IN_PROCESS, "algorithm.num_steps=1", "task.eval.interval=1"]
    first = _rows(run(overrides, tmp_path / "a").run_dir)[0]
    second = _rows(run(overrides, tmp_path / "b").run_dir)[0]
    assert first["eval/reward"] == second["eval/reward"] == first["eval/best_of_n"]
    assert round(first["eval/reward"] * 10, 6) == int(round(first["eval/reward"] * 10))
