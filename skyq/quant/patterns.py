"""compressed-tensors ignore-list semantics, and ignore lists built from module-name templates.

compressed-tensors, vLLM and SGLang match each `ignore` entry against MODULE names (no `.weight`):
an entry starting with `re:` is a regex applied with `re.match` (anchored at the start only), any
other entry must equal the module name exactly. Relax/slime matched parameter names with prefixes
instead, and loose patterns such as `re:.*mlp\\.gate\\.*` also catch `gate_proj` (pitfall P11), so
skyq emits only patterns anchored at both ends, one per module-name template.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from functools import lru_cache

REGEX_PREFIX = "re:"
_INDEX_SEGMENT = re.compile(r"(?:(?<=\.)|^)\d+(?=\.|$)")
"""An all-digit dot-separated segment (a layer, expert or block index)."""


class IgnorePatternError(ValueError):
    """An ignore entry that is not a valid compressed-tensors target."""


@lru_cache(maxsize=4096)
def _compiled(pattern: str) -> re.Pattern[str]:
    try:
        return re.compile(pattern)
    except re.error as err:
        raise IgnorePatternError(
            f"ignore entry {REGEX_PREFIX}{pattern!r} is not a valid regex: {err}"
        ) from None


def matches(module_name: str, entry: str) -> bool:
    """compressed-tensors `match_name`: `re:` -> `re.match`, otherwise exact equality."""
    if entry.startswith(REGEX_PREFIX):
        return _compiled(entry[len(REGEX_PREFIX) :]).match(module_name) is not None
    return entry == module_name


def matches_any(module_name: str, entries: Iterable[str]) -> bool:
    """Whether any ignore entry matches the module."""
    return any(matches(module_name, entry) for entry in entries)


def check_entries(entries: Iterable[str]) -> None:
    """Refuse entries that can never do what was meant: bad regexes and parameter names.

    An entry ending in `.weight` (or a regex ending in `weight$`) names a parameter; compressed-
    tensors compares module names, so it would silently match nothing.
    """
    for entry in entries:
        body = entry[len(REGEX_PREFIX) :] if entry.startswith(REGEX_PREFIX) else entry
        if entry.startswith(REGEX_PREFIX):
            _compiled(body)
        if re.search(r"weight\$?$", body):
            raise IgnorePatternError(
                f"ignore entry {entry!r} names a parameter; compressed-tensors matches module names "
                f"(drop the `.weight` suffix)"
            )


def template(module_name: str, keep_first_index: bool = False) -> str:
    """A module name with its all-digit segments generalized: `m.layers.3.mlp.experts.7.up_proj` ->
    `m.layers.*.mlp.experts.*.up_proj` (the first index kept literal when `keep_first_index`)."""
    if keep_first_index:
        first = _INDEX_SEGMENT.search(module_name)
        if first is None:
            return module_name
        return module_name[: first.end()] + _INDEX_SEGMENT.sub("*", module_name[first.end() :])
    return _INDEX_SEGMENT.sub("*", module_name)


def template_regex(tmpl: str) -> str:
    """The anchored compressed-tensors entry matching exactly the names of a template."""
    body = r"\.".join(r"\d+" if part == "*" else re.escape(part) for part in tmpl.split("."))
    return f"{REGEX_PREFIX}^{body}$"


def compact_ignore_list(ignored: Sequence[str], kept: Sequence[str]) -> list[str]:
    """The shortest anchored ignore list we build that matches every `ignored` module and no `kept` one.

    Names are grouped by template (digits generalized); a template none of whose names is kept
    becomes one `re:` entry (or the exact name when it has no digits). Templates shared with kept
    modules (e.g. the MTP layer's experts next to quantized decoder experts) are retried with the
    layer index literal, and only then listed name by name. Sorted, so the result is deterministic.
    """
    entries: list[str] = []
    remaining = sorted(set(ignored))
    for keep_first in (False, True):
        if not remaining:
            break
        kept_templates = {template(name, keep_first) for name in kept}
        groups: dict[str, list[str]] = {}
        for name in remaining:
            groups.setdefault(template(name, keep_first), []).append(name)
        remaining = []
        for tmpl, names in groups.items():
            if tmpl in kept_templates:
                remaining += names
            elif "*" in tmpl:
                entries.append(template_regex(tmpl))
            else:
                entries += names
    return sorted(entries + remaining)


def ignore_disagreements(
    ignore: Sequence[str], quantized: Iterable[str], unquantized: Iterable[str]
) -> list[str]:
    """Where an ignore list and a plan disagree: quantized modules it ignores, bf16 ones it does not.

    The trainer's fake-quant scope and the checkpoint's ignore list must cover the same modules
    (FORMATS.md, INT4); an empty result means they do.
    """
    check_entries(ignore)
    problems = [
        f"{name}: quantized by the plan but matched by ignore entry "
        f"{next(e for e in ignore if matches(name, e))!r}"
        for name in quantized
        if matches_any(name, ignore)
    ]
    problems += [
        f"{name}: kept bf16 by the plan but matched by no ignore entry (an engine would quantize it)"
        for name in unquantized
        if not matches_any(name, ignore)
    ]
    return problems
