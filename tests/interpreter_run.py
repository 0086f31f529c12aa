"""Runs a test module as a script under the Triton interpreter: TRITON_INTERPRET must be set before
`@triton.jit` runs, hence a subprocess. The module runs its check when given `--interpret` and
prints `marker` when it passed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def seeded_generator():
    """A torch generator for an interpreter check's random data: the seed from SKYQ_TEST_SEED or
    fresh, printed so a failure can be replayed."""
    import secrets

    import torch

    seed = int(os.environ.get("SKYQ_TEST_SEED", secrets.randbits(32)))
    print(f"SKYQ_TEST_SEED={seed}")
    return torch.Generator().manual_seed(seed)


def run_under_interpreter(script: str, marker: str = "interpreter check passed", timeout: int = 900) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, script, "--interpret"], env=env, capture_output=True, text=True, timeout=timeout
    )
    assert result.returncode == 0 and marker in result.stdout, result.stdout[-3000:] + result.stderr[-3000:]


def kernels_on_cpu() -> None:
    """Set up an interpreter check: torch's exact casts for the interpreter's, and `dispatch.uses_kernel`
    true for the CPU tensors the interpreter runs kernels on."""
    import skyq.quant.kernels.dispatch as dispatch
    from tests.quant.test_kernel_dispatch import _exact_interpreter_casts

    _exact_interpreter_casts()
    dispatch.uses_kernel = lambda t: True


def report(name: str, failures: list) -> None:
    """End an interpreter check: print `interpreter: <name> matches`, or the failures and exit 1."""
    if failures:
        print(f"interpreter: {name} FAILED", failures)
        sys.exit(1)
    print(f"interpreter: {name} matches")
