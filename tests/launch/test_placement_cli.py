"""`python -m skyq.train` inside a Ray cluster that cannot hold the run's placement group: one
`error:` line naming what was asked and what the cluster has, exit 2, no metrics written. The CLI
runs as `__main__` in a process that first starts a Ray with no CPU to give (as a run started inside a
running Ray joins it), so the plan's CPU bundles can never be placed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from .run_helpers import TEST_OVERRIDES

ROOT = Path(__file__).resolve().parents[2]

LAUNCH = """
import runpy, sys
import ray
from skyq.launch.ray_local import _loopback_node
with _loopback_node():
    ray.init(num_cpus=0, include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1")
sys.argv = ["skyq.train", *sys.argv[1:]]
runpy.run_module("skyq.train", run_name="__main__")
"""


def test_a_placement_group_the_cluster_cannot_hold_is_one_line_and_exit_2(cache_dir, tmp_path):
    run_dir = tmp_path / "run"
    argv = [*TEST_OVERRIDES, f"checkpoint.cache_dir={cache_dir}", "topology.placement_timeout_s=2",
            f"hydra.run.dir={run_dir}", "algorithm.num_steps=1"]  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-c", LAUNCH, *argv], capture_output=True, text=True, cwd=ROOT, timeout=300
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "placement group" in lines[0] and "CPU" in lines[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert not (run_dir / "metrics.jsonl").exists()
