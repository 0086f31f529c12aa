"""Crash-safe file writes: a final name only ever points at complete, durable bytes.

A write goes to a unique temp name in the same directory, is fsynced, then renamed over the final
name and the directory is fsynced. A crash at any moment leaves either the old file, the new file
or a stray temp file (removed by `remove_stale_temp_files` on the next run) - never a torn file.
Unique temp names (pid + random) keep two writers from sharing one temp file.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

TEMP_MARKER = ".skyq-tmp-"


def temp_path_for(path: Path) -> Path:
    """A unique hidden temp name next to `path` that `remove_stale_temp_files` recognises."""
    return path.with_name(f".{path.name}{TEMP_MARKER}{os.getpid()}-{uuid.uuid4().hex[:12]}")


def fsync_dir(directory: Path) -> None:
    """Make a rename inside `directory` durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def atomic_replace(path: Path) -> Iterator[Path]:
    """The protocol around one write: yields a temp path for the caller to write and fsync, then
    renames it over `path` and fsyncs the directory. On any error the temp file is removed."""
    tmp = temp_path_for(path)
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def atomic_write_bytes(path: Path, data: bytes | memoryview) -> None:
    """Write `data` to `path` via temp + fsync + rename; nothing is left under `path` on failure."""
    atomic_write_chunks(path, [data])


def atomic_write_chunks(
    path: Path,
    chunks: Iterable[bytes | memoryview],
    on_chunk: Callable[[bytes | memoryview], None] | None = None,
) -> int:
    """`atomic_write_bytes` of the concatenated `chunks`, calling `on_chunk` on each one after it
    is written (e.g. a hash update, while the chunk is still in cache); returns the bytes written."""
    size = 0
    with atomic_replace(path) as tmp, open(tmp, "wb", buffering=0) as f:
        for chunk in chunks:
            view = memoryview(chunk)
            written = 0
            while written < view.nbytes:  # a raw write may be partial
                written += f.write(view[written:])
            size += written
            if on_chunk is not None:
                on_chunk(chunk)
        os.fsync(f.fileno())
    return size


def atomic_write_json(path: Path, obj: Any) -> None:
    """Deterministic JSON (sorted keys, 2-space indent, trailing newline) written atomically."""
    atomic_write_bytes(path, json_bytes(obj))


def json_bytes(obj: Any) -> bytes:
    """The one JSON encoding skyq writes, so equal content gives equal bytes."""
    return (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode()


def remove_stale_temp_files(directory: Path) -> list[Path]:
    """Delete temp files a killed writer left in `directory` and its folders (never following a
    symlink out of it); returns what was removed."""
    stale = sorted(
        Path(root) / name
        for root, _, names in os.walk(directory)
        for name in names
        if TEMP_MARKER in name and not (Path(root) / name).is_symlink()
    )
    for p in stale:
        p.unlink(missing_ok=True)
    return stale
