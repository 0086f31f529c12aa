"""Hydra callback: after `python -m skyq.train -m ...`, write the sweep's comparison report."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig


class SweepReportCallback(Callback):
    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        if config.dry_run or not sweep_dir.is_dir():
            return
        from skyq.report import write_report

        table = write_report(sweep_dir)
        print(table)
