"""Hand a Ray actor its secret environment variables without Ray ever seeing them.

Ray writes an actor's `runtime_env` (env vars included) in clear to its session logs on every actor
start, and those logs are world-readable. So only allow-listed library settings
(`skyq.launch.redaction.is_public_env_name`) travel in `runtime_env`; every other `trainer.env.*` /
`rollout.env.*` variable is written by the driver to a file only its user can read (0600, in a 0700
directory) and the actor gets just the file's path. The actor sets the variables first thing in its
constructor (before it builds anything that reads them) and deletes the file; the driver deletes
what is left once the actors are up, or when they failed to start.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

ENV_FILE_PREFIX = "skyq-worker-env-"


def write_env_file(env: dict[str, str], label: str) -> Path | None:
    """Write `env` to a fresh owner-only file; None when there is nothing to hand over."""
    if not env:
        return None
    folder = Path(tempfile.mkdtemp(prefix=f"{ENV_FILE_PREFIX}{label}-"))  # mode 0700
    path = folder / "env.json"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(env, f)
    return path


def apply_env_file(path: str | None) -> None:
    """In the worker: set the variables `write_env_file` wrote, then delete the file."""
    if path is None:
        return
    file = Path(path)
    try:
        env = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise RuntimeError(f"{file}: the worker's environment file is unreadable ({exc})") from None
    if not isinstance(env, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in env.items()
    ):
        raise RuntimeError(f"{file}: the worker's environment file is not a {{name: value}} mapping")
    os.environ.update(env)
    remove_env_file(file)


def remove_env_file(path: Path | None) -> None:
    """Delete an env file and its private directory (already gone is fine)."""
    if path is not None:
        shutil.rmtree(path.parent, ignore_errors=True)
