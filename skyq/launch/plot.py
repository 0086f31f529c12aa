"""PNG plots of a run (reward and train/rollout mismatch) and of a sweep (one line per run).

Long series are drawn faint per step with a bold moving average over `SMOOTH_STEPS` steps.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from skyq.checkpoint.atomic import atomic_write_bytes

RUN_PANELS = (("reward", "reward (mean)"), ("mismatch/mean_abs_dlogp", "train/rollout mean |dlogp|"))
SWEEP_PANELS = (*RUN_PANELS, ("sync/total_s", "sync time (s)"))


def _pyplot() -> Any:
    """matplotlib's pyplot on the file-only Agg backend, imported when a plot is drawn: importing it
    costs every process that loads the run loop ~1 s (and a first import on a fresh machine builds
    matplotlib's font cache, seconds more), Ray workers included."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a training box
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, out: Path) -> Path:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110, bbox_inches="tight")
    _pyplot().close(fig)
    atomic_write_bytes(out, buffer.getvalue())
    return out


SMOOTH_STEPS = 10
"""Window of the moving average drawn over the per-step values (per-step rewards are noisy)."""


def _panel(ax: Any, rows: list[dict[str, Any]], key: str, label: str | None) -> None:
    points = [(r["step"], r[key]) for r in rows if isinstance(r[key], int | float)]
    steps, values = [p[0] for p in points], [p[1] for p in points]
    if len(values) < 2 * SMOOTH_STEPS:
        ax.plot(steps, values, marker=".", label=label)
        return
    (line,) = ax.plot(steps, values, alpha=0.3, linewidth=0.8)
    window = [
        sum(values[max(0, i - SMOOTH_STEPS + 1) : i + 1]) / min(i + 1, SMOOTH_STEPS)
        for i in range(len(values))
    ]
    ax.plot(steps, window, color=line.get_color(), label=label)


def plot_run(rows: list[dict[str, Any]], out: Path, *, title: str) -> Path:
    """Reward and mismatch against step, one panel each; the evals' reward (`task.eval.*`), where the run
    has any, as points on the reward panel."""
    fig, axes = _pyplot().subplots(1, len(RUN_PANELS), figsize=(10, 3.6))
    evals = [(r["step"], r["eval/reward"]) for r in rows if "eval/reward" in r]
    for ax, (key, ylabel) in zip(axes, RUN_PANELS):
        _panel(ax, rows, key, "train" if evals and key == "reward" else None)
        if evals and key == "reward":
            ax.plot([s for s, _ in evals], [v for _, v in evals], marker="o", linestyle="--", label="eval")
            ax.legend(fontsize=8)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    return _save(fig, out)


def plot_sweep(runs: dict[str, list[dict[str, Any]]], out: Path, *, title: str) -> Path:
    """Reward, mismatch and sync time against step, one line per run."""
    fig, axes = _pyplot().subplots(1, len(SWEEP_PANELS), figsize=(15, 3.8))
    for ax, (key, ylabel) in zip(axes, SWEEP_PANELS):
        for label, rows in runs.items():
            _panel(ax, rows, key, label)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(title)
    return _save(fig, out)
