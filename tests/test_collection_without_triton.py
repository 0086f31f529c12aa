"""`pip install -e .[dev]` then `pytest` on a machine where Triton does not install (macOS, a CPU-only
wheel of torch): every test module that reaches a Triton kernel module skips instead of failing
collection (`pytest.importorskip("triton")` before its imports). Checked by collecting, in a
subprocess with `import triton` made to fail, each test module that names Triton or a kernels
package (the modules that can import one)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_COLLECT = """
import sys
sys.modules["triton"] = None  # `import triton` raises ImportError, find_spec("triton") is None
import pytest
sys.exit(pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", *sys.argv[1:]]))
"""


def test_test_modules_collect_without_triton():
    modules = sorted(
        str(p.relative_to(ROOT))
        for p in (ROOT / "tests").rglob("test_*.py")
        if p != Path(__file__).resolve()
        and p.parent != ROOT / "tests" / "vllm"  # collected only in .venv-vllm (its conftest skips them here)
        and re.search(r"triton|\.kernels\b", p.read_text())
    )
    assert modules, "no test module names Triton or a kernels package: the selection above is stale"
    result = subprocess.run(
        [sys.executable, "-c", _COLLECT, *modules], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    errors = re.findall(r"^ERROR (\S+)", result.stdout, flags=re.M)
    assert result.returncode == 0 and not errors, f"{errors}\n{result.stdout[-4000:]}{result.stderr[-2000:]}"
