"""The run directory: unique per run, holding the resolved config, metrics, plot and checkpoints.

    <run dir>/config.yaml          the resolved config, human-readable (secrets redacted)
    <run dir>/skyq_config.json     the same, versioned: what a resume and `skyq.report` read
    <run dir>/metrics.jsonl        one JSON object per step
    <run dir>/metrics.png          reward and train/rollout mismatch
    <run dir>/checkpoints/step_N/  trainer state + run state (see checkpointing.py)
    <run dir>/.skyq_run.lock       the pid of the process running it

Two runs never share a directory: new ones are created with `exist_ok=False` under a timestamp plus
a random suffix, and every run (new or resumed) takes the lock file exclusively first.
"""

from __future__ import annotations

import json
import os
import socket
import uuid
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml

from skyq.checkpoint.atomic import atomic_write_bytes, atomic_write_json
from skyq.config.schema import CONFIG_VERSION
from skyq.launch.redaction import redact

CONFIG_YAML = "config.yaml"
CONFIG_JSON = "skyq_config.json"
METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "metrics.png"
LOCK_FILE = ".skyq_run.lock"
CONFIG_FORMAT = "skyq-config/1"

# Keys a resume may change: they do not alter what the run computes (length, logging, deadlines).
RESUME_MAY_CHANGE = (
    "algorithm.num_steps",
    "resume",
    "output_root",
    "dry_run",
    "logger",
    "checkpoint.save_interval",
    "rollout.weight_sync.timeout_s",
    "rollout.weight_sync.bucket_bytes",
    "rollout.weight_sync.verify_checksum",
)


class RunDirError(ValueError):
    """A run directory that cannot be used as asked (taken, not a skyq run, incompatible config)."""


def create_run_dir(output_root: str | Path) -> Path:
    """A new, empty run directory `<output_root>/<YYYYmmdd-HHMMSS>-<random>`."""
    root = Path(output_root).expanduser().resolve()
    root.mkdir(parents=True, exist_ok=True)
    run_dir = root / f"{datetime.now():%Y%m%d-%H%M%S}-{uuid.uuid4().hex[:8]}"
    run_dir.mkdir(exist_ok=False)
    return run_dir


def save_resolved_config(run_dir: str | Path, cfg_container: dict[str, Any]) -> None:
    """Write config.yaml and skyq_config.json (versioned), with environment secrets redacted."""
    run_dir = Path(run_dir)
    clean = redact(cfg_container)
    atomic_write_bytes(run_dir / CONFIG_YAML, yaml.safe_dump(clean, sort_keys=False).encode())
    atomic_write_json(
        run_dir / CONFIG_JSON,
        {"format": CONFIG_FORMAT, "config_version": CONFIG_VERSION, "config": clean},
    )


def load_saved_config(run_dir: str | Path) -> dict[str, Any]:
    """The config a run saved; refuses a directory that is not a skyq run."""
    path = Path(run_dir) / CONFIG_JSON
    if not path.is_file():
        raise RunDirError(
            f"{Path(run_dir)} holds no {CONFIG_JSON}: it is not a skyq run directory "
            "(resume=<run dir> must name the directory a run wrote, e.g. runs/20250101-120000-ab12cd34)"
        )
    try:
        saved = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise RunDirError(f"{path} is not valid JSON ({exc}); the run directory is damaged") from None
    if not isinstance(saved, dict) or set(saved) != {"format", "config_version", "config"}:
        raise RunDirError(
            f"{path} is not a {CONFIG_FORMAT} file (keys: {sorted(saved) if isinstance(saved, dict) else '-'})"
        )
    if saved["format"] != CONFIG_FORMAT:
        raise RunDirError(f"{path} has format {saved['format']!r}, expected {CONFIG_FORMAT!r}")
    if saved["config_version"] != CONFIG_VERSION:
        raise RunDirError(
            f"{path} was written by config schema version {saved['config_version']}, this skyq reads "
            f"version {CONFIG_VERSION}; resume it with the skyq version that started it"
        )
    return saved["config"]


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for key, value in tree.items():
            out.update(_flatten(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: tree}


def _may_change(key: str) -> bool:
    return any(key == k or key.startswith(f"{k}.") for k in RESUME_MAY_CHANGE)


def check_resume_compatible(run_dir: str | Path, cfg_container: dict[str, Any]) -> None:
    """Refuse to resume `run_dir` with a config that would compute something else."""
    saved = _flatten(load_saved_config(run_dir))
    now = _flatten(redact(cfg_container))
    differing = sorted(
        k for k in saved.keys() | now.keys() if not _may_change(k) and saved.get(k) != now.get(k)
    )
    if differing:
        shown = "; ".join(f"{k}: run has {saved.get(k)!r}, now {now.get(k)!r}" for k in differing[:8])
        more = f" (and {len(differing) - 8} more)" if len(differing) > 8 else ""
        raise RunDirError(
            f"cannot resume {run_dir}: its config differs in {shown}{more}. Resume with the run's own "
            f"settings (only {', '.join(RESUME_MAY_CHANGE)} may change), or start a new run."
        )


def claim_run_dir(run_dir: Path, *, resume: bool) -> None:
    """Take the run's lock file exclusively; a resume may take over a lock whose process is gone."""
    lock = run_dir / LOCK_FILE
    owner = f"{socket.gethostname()} {os.getpid()}"
    for _ in range(2):
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            holder = lock.read_text().strip()
            if resume and _holder_is_gone(holder):
                lock.unlink(missing_ok=True)
                continue
            raise RunDirError(
                f"run directory {run_dir} is in use by another run ({holder or 'unknown process'}); "
                "every run needs its own directory"
                + ("" if resume else " (use resume=<dir> to continue a killed run)")
            ) from None
        with os.fdopen(fd, "w") as f:
            f.write(owner)
        return
    raise RunDirError(f"could not take the lock {lock}: another process keeps re-creating it")


def release_run_dir(run_dir: Path) -> None:
    """Drop the lock (a killed run leaves it; a resume takes it over)."""
    (run_dir / LOCK_FILE).unlink(missing_ok=True)


def _holder_is_gone(holder: str) -> bool:
    host, _, pid = holder.partition(" ")
    if host != socket.gethostname() or not pid.isdigit():
        return False  # cannot tell for another machine: do not steal it
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False
