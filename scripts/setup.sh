#!/usr/bin/env bash
# Idempotent set-up: a virtual environment in .venv with torch and skyq (+ dev extras).
# Re-runs in well under a second once done (a stamp newer than pyproject.toml skips it).
# On a machine without an NVIDIA GPU it installs the CPU wheel torch==2.13.0, never a CUDA build,
# and triton==3.6.0 (its interpreter and its compiler run on the CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv
STAMP=$VENV/.skyq-setup-done
if [ -f "$STAMP" ] && [ "$STAMP" -nt pyproject.toml ]; then
  exit 0
fi
PY=${PYTHON:-python3}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --upgrade pip
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    "$VENV/bin/python" -m pip install --quiet "torch>=2.11,<2.14"
  else
    "$VENV/bin/python" -m pip install --quiet "torch==2.13.0"
  fi
fi
# Triton: on a GPU machine torch's CUDA build brings it; without one the tests still need it, to run
# the kernels under its interpreter and compile the Gluon ones for sm_90 (tests/quant/test_gluon_gemv.py)
if ! "$VENV/bin/python" -c "import triton" 2>/dev/null; then
  "$VENV/bin/python" -m pip install --quiet "triton==3.6.0"
fi
"$VENV/bin/python" -m pip install --quiet -e ".[dev]"
touch "$STAMP"
