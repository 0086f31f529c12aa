"""Per-step metrics: JSONL always, wandb when chosen, and a progress bar.

Every row of metrics.jsonl is one training step. The keys the driver writes:

    step, weight_version                     data position and the weights that produced the rollouts
    reward, response_length                  means over the step's responses
    loss, grad_norm, lr                      the trainer's update
    mismatch/mean_abs_dlogp, mismatch/k3_kl, mismatch/max_abs_dlogp
                                             trainer vs rollout-engine log-probs of the sampled tokens
    sync/bytes, sync/num_tensors, sync/num_buckets,
    sync/gather_s, sync/quantize_s, sync/transfer_s, sync/load_s, sync/total_s
    sync/full_manifest                       1 when the sync sent the full manifest, 0 when it
                                             referred to the layout the engine committed last time
    time/step_s, time/rollout_s, time/train_s
    train/<name>                             everything else the trainer reports
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import Any

from skyq.checkpoint.atomic import atomic_write_bytes
from skyq.config.enums import LoggerBackend
from skyq.config.schema import LoggerConfig
from skyq.config.validate import WANDB_MODES


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The rows of a metrics.jsonl; a torn last line (a run killed mid-write) is dropped."""
    if not path.is_file():
        return []
    rows = []
    lines = path.read_text().splitlines()
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                break
            raise ValueError(f"{path}:{i + 1}: not a JSON line; the metrics file is damaged") from None
    return rows


def keep_rows_before(path: Path, step: int) -> None:
    """Drop the rows of steps >= `step` (a killed run logged them after its last checkpoint)."""
    rows = [r for r in read_metrics(path) if r["step"] < step]
    atomic_write_bytes(path, "".join(json.dumps(r) + "\n" for r in rows).encode())


class MetricsLogger:
    """Writes each step's metrics to metrics.jsonl (fsynced), wandb and the progress bar."""

    def __init__(
        self,
        path: Path,
        *,
        logger_cfg: LoggerConfig,
        wandb_config: dict[str, Any],
        run_name: str,
        num_steps: int,
        start_step: int,
    ) -> None:
        self.path = path
        self._wandb = (
            _start_wandb(logger_cfg, wandb_config, path.parent, run_name)
            if _wants_wandb(logger_cfg)
            else None
        )
        self._file = open(path, "a")
        self._bar = None
        if logger_cfg.progress_bar:
            from tqdm import tqdm

            self._bar = tqdm(total=num_steps, initial=start_step, desc=run_name, unit="step", file=sys.stderr)

    def log(self, row: dict[str, Any]) -> None:
        clean = {k: _plain(v) for k, v in row.items()}
        self._file.write(json.dumps(clean) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in clean.items() if k != "step"}, step=clean["step"])
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix(
                reward=f"{clean['reward']:.3f}",
                mismatch=f"{clean['mismatch/mean_abs_dlogp']:.4f}",
                sync_kB=f"{clean['sync/bytes'] / 1024:.0f}",
            )

    def close(self) -> None:
        self._file.close()
        if self._bar is not None:
            self._bar.close()
        if self._wandb is not None:
            self._wandb.finish()

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _plain(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/inf; keep them visible instead of crashing the log
    return value


def _wants_wandb(logger_cfg: LoggerConfig) -> bool:
    return LoggerBackend(logger_cfg.backend) is LoggerBackend.wandb and logger_cfg.wandb_mode != "disabled"


def _start_wandb(logger_cfg: LoggerConfig, config: dict[str, Any], run_dir: Path, run_name: str) -> Any:
    import wandb

    if logger_cfg.wandb_mode not in WANDB_MODES:  # `validate` refuses it first; this guards direct calls
        raise ValueError(f"logger.wandb_mode={logger_cfg.wandb_mode!r}: use {', '.join(WANDB_MODES)}")
    # No console capture, command line, git or code snapshot: any of them could carry a secret
    # (e.g. a key passed as an override) into the run directory.
    settings = wandb.Settings(
        console="off", x_disable_meta=True, save_code=False, disable_git=True, silent=True
    )
    return wandb.init(
        project=logger_cfg.project,
        mode=logger_cfg.wandb_mode,
        dir=str(run_dir),
        name=run_name,
        id=run_name,
        resume="allow",
        config=config,
        settings=settings,
    )
