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
    r"\b\d+(\.\d+)? ?(ns|us|µs|ms|GB/s|TB/s|tok/s|tokens/s)\b"
    r"|\b\d+(\.\d+)?x( of)? (bf16|faster|slower)\b|\b\d+(\.\d+)?x -> \d"
    r"|\b\d+(\.\d+)?% of (peak|DRAM|bandwidth)"
)


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


def _offenders(pattern: re.Pattern) -> dict[str, list[str]]:
    offenders = {}
    for path in sorted((ROOT / "skyq").rglob("*.py")):
        name = str(path.relative_to(ROOT))
        hits = [f"{line}: {m.group(0)!r}" for line, text in _prose(path) for m in pattern.finditer(text)]
        if hits:
            offenders[name] = hits
    return offenders


def test_no_session_numbers_in_skyq_docstrings_or_comments():
    assert _offenders(SESSION) == {}


def test_no_benchmark_figures_in_skyq_docstrings_or_comments():
    """A rule tuned on a sweep names the sweep's section in docs/benchmarks.md, not its figures."""
    assert _offenders(FIGURE) == {}


def test_the_patterns_catch_what_they_are_for():
    assert SESSION.search("on the H200 (session 21)") and not SESSION.search("a session of the run")
    assert (
        FIGURE.search("took 5.6 us a call") and FIGURE.search("1.44x bf16") and FIGURE.search("at 320 GB/s")
    )
    assert (
        FIGURE.search("~2 ns per element")
        and FIGURE.search("0.66x of bf16 decode")
        and FIGURE.search("step 1.04x -> 1.11x")
        and FIGURE.search("DRAM at 8% of peak")
    )
    assert not FIGURE.search("128 x 128 blocks") and not FIGURE.search("deadline_s seconds")
    assert not FIGURE.search("partials are 4x larger") and not FIGURE.search("sleeps 5e-5 s at a time")
