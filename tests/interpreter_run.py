"""Runs a test module as a script under the Triton interpreter: TRITON_INTERPRET must be set before
`@triton.jit` runs, hence a subprocess. The module runs its check when given `--interpret` and
prints `marker` when it passed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_under_interpreter(script: str, marker: str = "interpreter check passed", timeout: int = 900) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, script, "--interpret"], env=env, capture_output=True, text=True, timeout=timeout
    )
    assert result.returncode == 0 and marker in result.stdout, result.stdout[-3000:] + result.stderr[-3000:]
