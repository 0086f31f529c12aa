"""Docstrings and comments in skyq/ say what the code does and why; what was measured, when and by
which command lives in docs/benchmarks.md. So no "session N" (the work log's numbering means nothing
to a reader of the code) and no benchmark figures (they go stale as the code and the machines change)."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SESSION = re.compile(r"\bsessions? \d+", re.IGNORECASE)
FIGURE = re.compile(
    r"\b\d+(\.\d+)? ?(us|µs|ms|GB/s|TB/s|tok/s|tokens/s)\b|\b\d+(\.\d+)?x (bf16|faster|slower)\b"
)

FIGURES_NOT_YET_MOVED = {
    # Temporary: these files still quote benchmark figures in docstrings or comments. Each entry goes
    # when its figures move to docs/benchmarks.md (`test_the_figure_exclusions_are_still_needed` makes
    # it go); a file not listed here must not gain any.
    # being edited elsewhere:
    "skyq/checkpoint/chunking.py",
    "skyq/checkpoint/fp8_cpu_kernel.py",
    "skyq/checkpoint/pipeline.py",
    "skyq/quant/errors.py",
    "skyq/quant/fp8_blockwise.py",
    "skyq/sync/torch_dist.py",
    # the decode kernels' tiling rules, which quote the sweeps they were fitted on:
    "skyq/rollout/kernels/gluon_fp8_gemv.py",
    "skyq/rollout/kernels/gluon_wo_gemv.py",
    "skyq/rollout/kernels/triton_fp8_gemv.py",
    "skyq/rollout/kernels/triton_int4_gemv.py",
    "skyq/rollout/quantized_linear.py",
}


def _prose(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every docstring (module, class, function, attribute) and comment in `path`."""
    source = path.read_text()
    found = [
        (node.lineno, node.value.value)
        for node in ast.walk(ast.parse(source, filename=str(path)))
        if isinstance(node, ast.Expr)
        and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, str)
    ]
    found += [
        (tok.start[0], tok.string)
        for tok in tokenize.generate_tokens(io.StringIO(source).readline)
        if tok.type == tokenize.COMMENT
    ]
    return found


def _offenders(pattern: re.Pattern, skip: set[str] = frozenset()) -> dict[str, list[str]]:
    offenders = {}
    for path in sorted((ROOT / "skyq").rglob("*.py")):
        name = str(path.relative_to(ROOT))
        if name in skip:
            continue
        hits = [f"{line}: {m.group(0)!r}" for line, text in _prose(path) for m in pattern.finditer(text)]
        if hits:
            offenders[name] = hits
    return offenders


def test_no_session_numbers_in_skyq_docstrings_or_comments():
    assert _offenders(SESSION) == {}


def test_no_benchmark_figures_in_skyq_docstrings_or_comments():
    assert _offenders(FIGURE, FIGURES_NOT_YET_MOVED) == {}


def test_the_figure_exclusions_are_still_needed():
    """An excluded file that no longer quotes figures leaves the list, so the rule covers it again."""
    stale = {
        name for name in FIGURES_NOT_YET_MOVED if not (ROOT / name).exists() or name not in _offenders(FIGURE)
    }
    assert stale == set()


def test_the_patterns_catch_what_they_are_for():
    assert SESSION.search("on the H200 (session 21)") and not SESSION.search("a session of the run")
    assert (
        FIGURE.search("took 5.6 us a call") and FIGURE.search("1.44x bf16") and FIGURE.search("at 320 GB/s")
    )
    assert not FIGURE.search("128 x 128 blocks") and not FIGURE.search("deadline_s seconds")
