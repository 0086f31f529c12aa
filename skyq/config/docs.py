"""Generate docs/configuration.md from the schema's field docstrings.

`python -m skyq.config.docs > docs/configuration.md`; a test fails when the file is stale.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
from enum import Enum

from skyq.config import enums, schema
from skyq.config.backends import is_universal, readers
from skyq.config.enums import TrainerBackend
from skyq.config.store import GROUPS


def field_docs(cls: type) -> dict[str, str]:
    """The string literal under each annotated field of a dataclass (its one-line docstring)."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = nxt.value.value.strip()
    return docs


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        value = f.default_factory()  # type: ignore[misc]
    else:
        return "(required)"
    if isinstance(value, Enum):
        return f"`{value.value}`"
    if dataclasses.is_dataclass(value):
        return "(section)"
    return f"`{value!r}`"


def _type_name(annotation: str) -> str:
    enum = getattr(enums, annotation, None) if annotation.isidentifier() else None
    if isinstance(enum, type) and issubclass(enum, Enum):
        return " \\| ".join(m.value for m in enum)
    return annotation.replace("|", "\\|")


def _section(cls: type, prefix: str, lines: list[str]) -> None:
    docs = field_docs(cls)
    nested = []
    lines += [
        f"### `{prefix.rstrip('.') or '(top level)'}`",
        "",
        "| key | type | default | allowed | read by | meaning |",
        "|---|---|---|---|---|---|",
    ]
    for f in dataclasses.fields(cls):
        sub = getattr(schema, str(f.type), None)
        if isinstance(sub, type) and dataclasses.is_dataclass(sub):
            nested.append((sub, f"{prefix}{f.name}."))
            continue
        rng = f.metadata.get("range")
        allowed = str(rng).replace("<", "&lt;") if rng is not None else ""
        lines.append(
            f"| `{prefix}{f.name}` | {_type_name(str(f.type))} | {_default(f)} | {allowed} | "
            f"{_read_by(prefix + f.name)} | {docs[f.name]} |"
        )
    lines.append("")
    for sub, sub_prefix in nested:
        _section(sub, sub_prefix, lines)


def _read_by(key: str) -> str:
    """`all`, or the backends that read the key (`skyq.config.backends`)."""
    if is_universal(key):
        return "all"
    names = [f"{'trainer' if isinstance(b, TrainerBackend) else 'rollout'}={b.value}" for b in readers(key)]
    return ", ".join(names)


def render() -> str:
    lines = [
        "# Configuration reference",
        "",
        "Generated from the field docstrings of `skyq/config/schema.py` by `make docs`",
        "(`python -m skyq.config.docs`); a test fails when this file is stale. Every default lives in",
        'exactly one dataclass field; "allowed" is a numeric field\'s range, which `validate` checks',
        'before a run starts. "read by" names the backends that read a key (`skyq/config/backends.py`);',
        "set away from its default on backends that do not read it, a key is refused, not ignored.",
        "Config groups (`conf/<group>/<option>.yaml`) only pick and",
        "override: " + ", ".join(f"`{g}`" for g in GROUPS) + ", plus `recipe` (`recipes/`).",
        "The seed scripts' flags map to these keys in [seed_flags.md](seed_flags.md).",
        "",
    ]
    _section(schema.TrainConfig, "", lines)
    return "\n".join(lines)


if __name__ == "__main__":
    print(render(), end="")
