"""tests/vllm run only in the vLLM environment (scripts/setup_vllm.sh, .venv-vllm): elsewhere the
whole directory is skipped at collection, so the main environment still collects the suite."""

from __future__ import annotations

import importlib.util

collect_ignore_glob = [] if importlib.util.find_spec("vllm") is not None else ["test_*.py"]
