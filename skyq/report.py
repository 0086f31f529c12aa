"""`python -m skyq.report <multirun dir>`: compare the runs of a sweep in one table and one plot.

For every run under the directory (any folder holding skyq_config.json and metrics.jsonl) the
table gives its precision, final reward (mean of the last 10 steps), train/rollout mismatch (mean
|dlogp| over the run), bytes per weight sync and median sync time, the last three also relative to
the bf16 run(s) of the sweep. Writes report.md and report.png into the directory.
"""

from __future__ import annotations

import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

from skyq.checkpoint.atomic import atomic_write_bytes
from skyq.config.enums import Precision
from skyq.launch.metrics import read_metrics
from skyq.launch.plot import plot_sweep
from skyq.launch.rundir import CONFIG_JSON, METRICS_FILE, load_saved_config

REPORT_MD = "report.md"
REPORT_PNG = "report.png"
FINAL_STEPS = 10
_ORDER = {p.value: i for i, p in enumerate(Precision)}


@dataclass(frozen=True, slots=True)
class RunSummary:
    path: Path
    name: str
    precision: str
    steps: int
    final_reward: float
    mismatch: float
    bytes_per_sync: float
    sync_s: float


def find_runs(multirun_dir: Path) -> list[Path]:
    """Run directories under `multirun_dir` (itself included) with a saved config and metrics."""
    return sorted(p.parent for p in multirun_dir.rglob(CONFIG_JSON) if (p.parent / METRICS_FILE).is_file())


def summarize(run_dir: Path, root: Path) -> RunSummary:
    rows = read_metrics(run_dir / METRICS_FILE)
    if not rows:
        raise ValueError(f"{run_dir / METRICS_FILE} has no steps; was the run killed before its first step?")
    config = load_saved_config(run_dir)
    last = rows[-FINAL_STEPS:]
    return RunSummary(
        path=run_dir,
        name=str(run_dir.relative_to(root)) if run_dir != root else run_dir.name,
        precision=config["precision"]["name"],
        steps=len(rows),
        final_reward=statistics.fmean(r["reward"] for r in last),
        mismatch=statistics.fmean(r["mismatch/mean_abs_dlogp"] for r in rows),
        bytes_per_sync=statistics.fmean(r["sync/bytes"] for r in rows),
        sync_s=statistics.median(r["sync/total_s"] for r in rows),
    )


def _ratio(value: float, baseline: float | None) -> str:
    return f"{value / baseline:.2f}x" if baseline else "-"


def render_table(runs: list[RunSummary]) -> str:
    """Markdown table; ratios are against the mean of the sweep's bf16 runs ("-" without one)."""
    bf16 = [r for r in runs if r.precision == Precision.bf16.value]

    def base(field: str) -> float | None:
        return statistics.fmean(getattr(r, field) for r in bf16) if bf16 else None

    lines = [
        "| run | precision | steps | final reward (last 10) | mismatch mean abs dlogp | vs bf16 "
        "| bytes/sync | vs bf16 | sync time (median s) | vs bf16 |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        lines.append(
            f"| {r.name} | {r.precision} | {r.steps} | {r.final_reward:.3f} | {r.mismatch:.5f} | "
            f"{_ratio(r.mismatch, base('mismatch'))} | {r.bytes_per_sync:,.0f} | "
            f"{_ratio(r.bytes_per_sync, base('bytes_per_sync'))} | {r.sync_s:.4f} | {_ratio(r.sync_s, base('sync_s'))} |"
        )
    return "\n".join(lines) + "\n"


def write_report(multirun_dir: str | Path) -> str:
    """Write report.md and report.png into `multirun_dir`; returns the markdown table."""
    root = Path(multirun_dir).expanduser().resolve()
    run_dirs = find_runs(root)
    if not run_dirs:
        raise ValueError(f"no runs under {root}: expected folders holding {CONFIG_JSON} and {METRICS_FILE}")
    runs = sorted((summarize(d, root) for d in run_dirs), key=lambda r: (_ORDER.get(r.precision, 99), r.name))
    table = render_table(runs)
    atomic_write_bytes(root / REPORT_MD, f"# skyq sweep report: {root.name}\n\n{table}".encode())
    series = {f"{r.precision} ({r.name})": read_metrics(r.path / METRICS_FILE) for r in runs}
    plot_sweep(series, root / REPORT_PNG, title=f"skyq sweep {root.name}")
    return table


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m skyq.report <multirun dir>", file=sys.stderr)
        return 2
    try:
        print(write_report(args[0]), end="")
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
