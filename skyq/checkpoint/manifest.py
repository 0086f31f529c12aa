"""`skyq_manifest.json`: the sha256 and size of every file a skyq converter wrote.

safetensors validates only a file's header and offsets, so a zero-filled or bit-flipped payload
loads silently; the manifest is what catches it (`inspect --verify`, and every converter reading a
skyq-written input). It is written after the index and config: its presence marks a finished run.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from skyq.checkpoint.errors import CheckpointError

MANIFEST_NAME = "skyq_manifest.json"
MANIFEST_VERSION = 1
_CHUNK = 8 << 20


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in chunks (hashlib releases the GIL on large updates)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def file_record(path: Path) -> dict[str, Any]:
    return {"sha256": sha256_file(path), "bytes": path.stat().st_size}


def build_manifest(*, tool: str, fingerprint: str, options: dict[str, Any], files: dict[str, dict]) -> dict:
    """The manifest object; `files` maps a file name to `file_record(...)`."""
    return {
        "skyq_manifest_version": MANIFEST_VERSION,
        "tool": tool,
        "fingerprint": fingerprint,
        "options": options,
        "files": dict(sorted(files.items())),
    }


def read_manifest(path: Path) -> dict[str, Any]:
    try:
        manifest = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: unreadable manifest ({e})") from e
    if not isinstance(manifest, dict) or manifest.get("skyq_manifest_version") != MANIFEST_VERSION:
        raise CheckpointError(f"{path}: not a skyq manifest of version {MANIFEST_VERSION}")
    if not isinstance(manifest.get("files"), dict):
        raise CheckpointError(f"{path}: manifest has no 'files' object")
    return manifest


def verify_files(directory: Path, manifest: dict[str, Any]) -> list[str]:
    """Problems found checking every file the manifest lists (empty list: all good)."""
    problems = []
    for name, record in sorted(manifest["files"].items()):
        path = directory / name
        if not path.is_file():
            problems.append(f"{path}: listed in {MANIFEST_NAME} but missing")
        elif path.stat().st_size != record["bytes"]:
            problems.append(
                f"{path}: {path.stat().st_size} bytes, manifest says {record['bytes']} (truncated?)"
            )
        elif sha256_file(path) != record["sha256"]:
            problems.append(f"{path}: sha256 differs from {MANIFEST_NAME} (corrupt payload)")
    return problems
