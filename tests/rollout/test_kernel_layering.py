"""The engine's decode kernels live under skyq.rollout.kernels and depend on the shared quantizers in
skyq.quant.kernels, never the other way round: no module under skyq/quant imports skyq.rollout (not
even lazily inside a function), and importing the quantizers' dispatcher loads none of the engine's
modules (it once re-exported the INT4 / MXFP8 decode linears, which imported it back: a cycle)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_no_quant_module_imports_the_rollout_package():
    offenders = {
        str(path.relative_to(ROOT)): sorted(
            m for m in _imported_modules(path) if m.startswith("skyq.rollout")
        )
        for path in sorted((ROOT / "skyq" / "quant").rglob("*.py"))
    }
    assert not {k: v for k, v in offenders.items() if v}


def test_the_dispatcher_loads_no_engine_module_and_the_decode_linears_import_first():
    dispatcher = (
        "import sys\n"
        "import skyq.quant.kernels.dispatch as d\n"
        "assert not [m for m in sys.modules if m.startswith('skyq.rollout')], sorted(sys.modules)\n"
        "assert not hasattr(d, 'int4_weight_only_linear') and not hasattr(d, 'fp8_weight_only_linear')\n"
    )
    subprocess.run([sys.executable, "-c", dispatcher], check=True, cwd=ROOT)
    subprocess.run(
        [sys.executable, "-c", "import skyq.rollout.kernels.int4_mxfp8_linear"], check=True, cwd=ROOT
    )
