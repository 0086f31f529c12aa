"""The user's dataset files (JSONL or parquet) read into prompt records; skyq never downloads data.

A row gives a prompt (`task.prompt_key`), a reference answer (`task.label_key`) and, for multimodal tasks,
images (`task.image_key`). A key may be dotted to reach into a struct: DAPO-Math-17k's parquet keeps its
answer at `reward_model.ground_truth`. docs/data.md lists the seed datasets' layouts.

A prompt is a string (one user turn) or a chat message list (`[{"role", "content"}, ...]`, content a string
or a list of `{"type": "text" | "image"}` parts). In a string content, `<image>` marks where an image goes
(the verl / slime convention); a multimodal prompt without any marker gets its images at the start of its
first user turn, as open-r1-multimodal builds its prompts.

Parquet needs pyarrow (imported only for a .parquet file); JSONL needs nothing.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from skyq.rl.images import ImageError, image_bytes

SUFFIXES = (".jsonl", ".parquet")
"""File types skyq reads: JSON lines, and parquet (with pyarrow)."""

IMAGE_MARKER = "<image>"

Messages = list[dict[str, Any]]


class DatasetError(ValueError):
    """A dataset file skyq cannot read, or a row without a key the task needs."""


@dataclass(frozen=True, slots=True)
class Record:
    where: str
    """The row in errors and messages: `<file>:<line>` (JSONL) or `<file> row <n>` (parquet, 0-based)."""
    messages: Messages
    """The prompt as chat messages; image parts are `{"type": "image"}`."""
    answer: str
    """Reference answer, as text."""
    images: tuple[bytes, ...] = ()
    """Encoded images, in the order of the prompt's image parts."""


def local_file(value: str | None, *, key: str) -> Path:
    """The local dataset file config `key` names; refuses a hub name or a missing file."""
    if value is None:
        raise DatasetError(f"{key} is not set: point it at a local {' or '.join(SUFFIXES)} file")
    path = Path(value).expanduser()
    if not path.is_file():
        raise DatasetError(
            f"{key}={value!r} is not a local file; skyq never downloads data at run time: download the "
            f"dataset yourself and point {key} at its {' or '.join(SUFFIXES)} file (docs/data.md)"
        )
    if path.suffix not in SUFFIXES:
        raise DatasetError(f"{key}={value!r}: skyq reads {' and '.join(SUFFIXES)} files, not {path.suffix!r}")
    return path


def read_rows(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """(where, row) for every row of a JSONL or parquet file, in file order."""
    if path.suffix == ".parquet":
        yield from _parquet_rows(path)
        return
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{line_no}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DatasetError(f"{where}: not a JSON line ({exc.msg})") from None
            if not isinstance(row, dict):
                raise DatasetError(f"{where}: a row must be a JSON object, got {type(row).__name__}")
            yield where, row


def _parquet_rows(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DatasetError(
            f"{path}: reading parquet needs pyarrow, which is not installed. Fix: pip install pyarrow, "
            "or convert the file to JSONL"
        ) from None
    try:
        index = 0
        for batch in pq.ParquetFile(path).iter_batches(batch_size=256):
            for row in batch.to_pylist():
                yield f"{path} row {index}", row
                index += 1
    except (OSError, ValueError) as exc:  # pyarrow's ArrowInvalid is a ValueError
        raise DatasetError(f"{path}: not a readable parquet file ({exc})") from None


def lookup(row: dict[str, Any], key: str, *, where: str, config_key: str) -> Any:
    """`row[key]`, where a dotted key reaches into structs (`reward_model.ground_truth`)."""
    if key in row:
        value = row[key]
    else:
        value = row
        for part in key.split("."):
            if not isinstance(value, dict) or part not in value:
                raise DatasetError(
                    f"{where}: no key {key!r} (the row's keys: {sorted(row)}). Fix: {config_key}=<the key "
                    "holding it; dotted for a struct field>"
                )
            value = value[part]
    if value is None:
        raise DatasetError(f"{where}: {key!r} ({config_key}) is null")
    return value


def to_messages(
    value: Any, *, where: str, config_key: str, markers: bool, question_suffix: str | None = None
) -> Messages:
    """A row's prompt as chat messages; a plain string is one user turn, `question_suffix` appended.
    With `markers`, `<image>` in a string content becomes an image part."""
    if isinstance(value, str):
        value = [{"role": "user", "content": value + (question_suffix or "")}]
    if not (
        isinstance(value, list)
        and value
        and all(isinstance(m, dict) and "role" in m and "content" in m for m in value)
    ):
        raise DatasetError(
            f"{where}: the prompt ({config_key}) must be a string or a list of {{role, content}} chat "
            f"messages, got {type(value).__name__}"
        )
    return [{**m, "content": _content(m["content"], where, markers)} for m in value]


def _content(content: Any, where: str, markers: bool) -> str | list[dict[str, Any]]:
    if isinstance(content, str):
        if not markers or IMAGE_MARKER not in content:
            return content
        parts: list[dict[str, Any]] = []
        for i, text in enumerate(content.split(IMAGE_MARKER)):
            if i:
                parts.append({"type": "image"})
            if text:
                parts.append({"type": "text", "text": text})
        return parts
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") in ("text", "image") for p in content
    ):
        # Parquet structs carry every field of the column's schema, None where a part lacks it.
        return [{k: v for k, v in p.items() if v is not None} for p in content]
    raise DatasetError(
        f"{where}: a message content must be a string or a list of {{type: text | image}} parts"
    )


def image_parts(messages: Messages) -> int:
    """How many image parts the messages hold."""
    return sum(
        1
        for m in messages
        if isinstance(m["content"], list)
        for p in m["content"]
        if p.get("type") == "image"
    )


def place_images(messages: Messages, count: int, *, where: str) -> Messages:
    """Messages with one image part per image: as marked, or (no marker) at the start of the first user turn."""
    marked = image_parts(messages)
    if marked == count:
        return messages
    if marked:
        raise DatasetError(f"{where}: the prompt marks {marked} image(s) but the row holds {count}")
    users = [i for i, m in enumerate(messages) if m["role"] == "user"]
    if not users:
        raise DatasetError(f"{where}: a prompt with images needs a user turn to hold them")
    first = users[0]
    content = messages[first]["content"]
    text = [{"type": "text", "text": content}] if isinstance(content, str) else content
    out = list(messages)
    out[first] = {**messages[first], "content": [*({"type": "image"} for _ in range(count)), *text]}
    return out


def read_records(
    path: Path,
    *,
    prompt_key: str,
    label_key: str,
    image_key: str | None,
    config_prefix: str = "task",
    question_suffix: str | None = None,
) -> Iterator[Record]:
    """Every row of `path` as a Record; refuses a row that lacks a key or holds a bad prompt or image.

    `config_prefix` names the keys' config group in errors (`task` or `task.eval`); `question_suffix` is
    appended to a prompt given as a plain string (a bare question).
    """
    for where, row in read_rows(path):
        messages = to_messages(
            lookup(row, prompt_key, where=where, config_key=f"{config_prefix}.prompt_key"),
            where=where,
            config_key=f"{config_prefix}.prompt_key",
            markers=image_key is not None,
            question_suffix=question_suffix,
        )
        answer = lookup(row, label_key, where=where, config_key=f"{config_prefix}.label_key")
        if isinstance(answer, (list, tuple)) and len(answer) == 1:  # verl's one-element ground_truth lists
            answer = answer[0]
        if not isinstance(answer, (str, int, float)) or isinstance(answer, bool):
            raise DatasetError(
                f"{where}: the answer ({config_prefix}.label_key={label_key!r}) must be text or a number, "
                f"got {type(answer).__name__}"
            )
        images: tuple[bytes, ...] = ()
        if image_key is not None:
            cell = lookup(row, image_key, where=where, config_key="task.image_key")
            try:
                images = image_bytes(cell, base_dir=path.parent, where=where)
            except ImageError as exc:
                raise DatasetError(str(exc)) from None
            messages = place_images(messages, len(images), where=where)
        elif image_parts(messages):
            raise DatasetError(
                f"{where}: the prompt has image parts but task.image_key is not set. Fix: task.image_key=<the "
                "column holding the images>, or a text-only dataset"
            )
        yield Record(where=where, messages=messages, answer=str(answer), images=images)
