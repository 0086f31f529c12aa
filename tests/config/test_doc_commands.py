"""The dry-run commands the docs show are ones validation accepts: a reader who copies
`python -m skyq.train ... dry_run=true` from the README, the `--help` header (conf/train.yaml), docs/ or
examples/ gets the plan, not a refusal (a command kept after a validation rule tightened is caught here)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from skyq.config.store import compose, to_object
from skyq.config.validate import validate

ROOT = Path(__file__).resolve().parents[2]
SOURCES = [ROOT / "README.md", ROOT / "conf" / "train.yaml", *sorted((ROOT / "docs").glob("*.md"))]
SOURCES += sorted((ROOT / "examples").rglob("*.md"))
COMMAND = re.compile(r"python3? -m skyq\.train ((?:[\w.\-/]+=[^\s`#]+ )*dry_run=true)")


def _commands() -> list[tuple[str, str]]:
    found = []
    for path in SOURCES:
        for match in COMMAND.finditer(path.read_text()):
            found.append((str(path.relative_to(ROOT)), match.group(1)))
    return found


def test_the_docs_show_dry_run_commands():
    sources = {source for source, _ in _commands()}
    assert {"README.md", "conf/train.yaml", "docs/recipes.md"} <= sources, sources


@pytest.mark.parametrize(("source", "command"), _commands(), ids=lambda v: v)
def test_a_dry_run_command_in_the_docs_validates(source, command):
    overrides = [o for o in command.split() if o != "dry_run=true"]
    validate(to_object(compose(overrides)))


def test_the_pattern_finds_what_a_reader_would_copy():
    text = "x `python -m skyq.train precision=mxfp8 topology=8gpu dry_run=true` and python -m skyq.train ... dry_run=true"
    assert COMMAND.findall(text) == ["precision=mxfp8 topology=8gpu dry_run=true"]
