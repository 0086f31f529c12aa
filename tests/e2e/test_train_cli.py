"""`python -m skyq.train` as a user runs it: a short real run, then `resume=<run dir>` (real Ray actors)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _train(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "skyq.train", *args], capture_output=True, text=True, cwd=cwd, timeout=900
    )


def test_short_run_then_resume_continues_at_the_same_step_and_version(tmp_path):
    cache = ROOT / ".skyq_cache"  # the tiny checkpoint is built once and shared with other tests
    common = [f"output_root={tmp_path}", f"checkpoint.cache_dir={cache}", "logger.progress_bar=false"]
    first = _train(
        "algorithm.num_steps=2",
        "checkpoint.save_interval=1",
        "algorithm.global_batch_size=32",
        "seed=3",
        *common,
        cwd=tmp_path,
    )
    assert first.returncode == 0, first.stderr[-3000:]
    (run_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    assert {"metrics.jsonl", "config.yaml", "skyq_config.json"} <= {p.name for p in run_dir.iterdir()}
    saved = json.loads((run_dir / "skyq_config.json").read_text())
    assert saved["config_version"] == 1 and saved["config"]["seed"] == 3

    refused = _train(f"resume={run_dir}", "precision=bf16", *common, cwd=tmp_path)
    assert refused.returncode == 2 and "group overrides" in refused.stderr

    second = _train(f"resume={run_dir}", "algorithm.num_steps=3", *common, cwd=tmp_path)
    assert second.returncode == 0, second.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in rows]
    assert steps == [0, 1, 2], steps
    assert [r["weight_version"] for r in rows] == [1, 2, 3]
    assert [p for p in tmp_path.iterdir() if p.is_dir()] == [run_dir]  # the resume made no new run dir
