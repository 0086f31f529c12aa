"""`python -m skyq.train -m ...` keeps one Ray session for its jobs and leaves nothing of a job in
it for the next: the jobs here are simulations of the 2-GPU topology (a logical cluster, stand-in
workers), the cheapest jobs that reserve a placement group and start Ray workers."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_sweep_shares_one_ray_session_and_leaks_nothing_between_jobs(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "skyq.train", "-m", "simulate=true", "recipe=small_moe_fp8_blockwise_2gpu",
         "seed=0,1,2", f"output_root={tmp_path}"],
        capture_output=True, text=True, cwd=ROOT, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    starts = re.findall(
        r"sweep: job (\d) runs in the sweep's Ray session (\S+) \(started for job (\d); (.*)\)", out.stdout
    )
    assert [s[0] for s in starts] == ["0", "1", "2"], out.stdout
    assert len({s[1] for s in starts}) == 1 and {s[2] for s in starts} == {"0"}  # one Ray start for the sweep
    assert {s[3] for s in starts} == {"0 placement group(s), 0 actor(s) alive"}
    ends = re.findall(
        r"sweep: job \d ended; removed (\d+) placement group\(s\) and (\d+) actor\(s\)", out.stdout
    )
    assert ends == [("0", "0")] * 3
    assert out.stdout.count("stand-ins: 1 trainer rank(s), 1 of 1 engine(s)") == 3
