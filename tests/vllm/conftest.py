"""tests/vllm run only in the vLLM environment (scripts/setup_vllm.sh, .venv-vllm): elsewhere the
whole directory is skipped at collection, so the main environment still collects the suite.

pytest puts tests/ on sys.path, where this very directory is a namespace package named `vllm`: only a
spec with an origin (a real, installed vLLM) counts."""

from __future__ import annotations

import importlib.util

_spec = importlib.util.find_spec("vllm")
collect_ignore_glob = [] if _spec is not None and _spec.origin is not None else ["test_*.py"]
