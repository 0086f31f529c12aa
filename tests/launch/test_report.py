"""`skyq.report` on synthetic sweeps: the table's numbers and ratios, and its refusals."""

from __future__ import annotations

import json

import pytest

from skyq.launch.rundir import save_resolved_config
from skyq.report import main, write_report

from .run_helpers import compose_config


def fake_run(run_dir, precision, rewards, *, mismatch, nbytes, sync_s):
    run_dir.mkdir(parents=True)
    save_resolved_config(run_dir, compose_config([f"precision={precision}"])[1])
    rows = [
        {
            "step": i,
            "reward": r,
            "mismatch/mean_abs_dlogp": mismatch,
            "sync/bytes": nbytes,
            "sync/total_s": sync_s,
        }
        for i, r in enumerate(rewards)
    ]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_table_gives_final_reward_and_ratios_to_bf16(tmp_path):
    fake_run(
        tmp_path / "1-fp8_blockwise",
        "fp8_blockwise",
        [0.0] * 5 + [0.5] * 10,
        mismatch=0.006,
        nbytes=500,
        sync_s=0.05,
    )
    fake_run(tmp_path / "0-bf16", "bf16", [0.2] * 12, mismatch=0.004, nbytes=1000, sync_s=0.1)
    table = write_report(tmp_path)
    header, _, bf16, fp8 = table.strip().splitlines()
    assert "final reward (last 10)" in header
    assert bf16.split("|")[1:5] == [" 0-bf16 ", " bf16 ", " 12 ", " 0.200 "]
    cells = [c.strip() for c in fp8.split("|")[1:-1]]
    assert cells == [
        "1-fp8_blockwise",
        "fp8_blockwise",
        "15",
        "0.500",
        "0.00600",
        "1.50x",
        "500",
        "0.50x",
        "0.0500",
        "0.50x",
    ]
    assert (tmp_path / "report.png").stat().st_size > 0


def test_without_a_bf16_run_the_ratios_are_blank(tmp_path, capsys):
    fake_run(tmp_path / "a", "mxfp8", [0.1, 0.3], mismatch=0.01, nbytes=10, sync_s=0.01)
    assert main([str(tmp_path)]) == 0
    row = capsys.readouterr().out.strip().splitlines()[-1]
    assert [c.strip() for c in row.split("|")[1:-1]][5::2] == ["-", "-", "-"]


def test_a_dir_without_runs_is_refused(tmp_path, capsys):
    assert main([str(tmp_path)]) == 2
    assert "no runs under" in capsys.readouterr().err
    with pytest.raises(ValueError, match="no runs under"):
        write_report(tmp_path)


def test_the_run_loop_does_not_import_matplotlib_until_it_plots():
    """matplotlib costs every process that loads the run loop (Ray workers too) ~1 s to import; it is
    imported when a plot is drawn."""
    import subprocess
    import sys

    code = "import sys, skyq.train, skyq.launch.loop, skyq.launch.actors; print('matplotlib' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
