"""`skyq_manifest.json`: the sha256 and size of every file a skyq converter wrote.

safetensors validates only a file's header and offsets, so a zero-filled or bit-flipped payload
loads silently; the manifest is what catches it (`inspect --verify`, and every converter reading a
skyq-written input). It is written after the index and config: its presence marks a finished run.

It also records what the output was converted from: `inputs` (each input shard's identity, see
`reader.stat_identity`; no path, so a published checkpoint names no local directory) and `inputs_id`, a digest of the conversion and its inputs,
which every shard's record repeats. A shard whose `inputs_id` differs from the manifest's came from
another conversion: the output is a mix of two checkpoints (`mixed_shards`).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path, PurePosixPath
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


def build_manifest(
    *, tool: str, fingerprint: str, options: dict[str, Any], files: dict[str, dict], inputs: dict[str, Any],
    inputs_id: str,
) -> dict:  # fmt: skip
    """The manifest object; `files` maps a file name to `file_record(...)` (a shard's record also
    carries its `inputs_id`); `inputs` maps each input shard to its identity."""
    return {
        "skyq_manifest_version": MANIFEST_VERSION,
        "tool": tool,
        "fingerprint": fingerprint,
        "options": options,
        "inputs": inputs,
        "inputs_id": inputs_id,
        "files": dict(sorted(files.items())),
    }


def mixed_shards(manifest: dict[str, Any]) -> list[str]:
    """Shards the manifest records as converted from other inputs than the checkpoint as a whole."""
    expected = manifest.get("inputs_id")
    return [
        f"{name} was converted from other inputs (inputs_id {record.get('inputs_id')}) than the rest of "
        f"the checkpoint ({expected}): the output mixes two conversions"
        for name, record in sorted(manifest["files"].items())
        if name.endswith(".safetensors") and expected is not None and record.get("inputs_id") != expected
    ]


def is_plain_relative(name: object) -> bool:
    """True for a relative path that stays inside the dir it is relative to (no `..`, no root)."""
    if not isinstance(name, str) or not name or "\\" in name or "\0" in name:
        return False
    path = PurePosixPath(name)
    return not path.is_absolute() and all(part not in ("", ".", "..") for part in path.parts)


def read_manifest(path: Path) -> dict[str, Any]:
    try:
        manifest = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: unreadable manifest ({e})") from e
    if not isinstance(manifest, dict) or manifest.get("skyq_manifest_version") != MANIFEST_VERSION:
        raise CheckpointError(f"{path}: not a skyq manifest of version {MANIFEST_VERSION}")
    if not isinstance(manifest.get("files"), dict):
        raise CheckpointError(f"{path}: manifest has no 'files' object")
    bad = [name for name in manifest["files"] if not is_plain_relative(name)]
    if bad:
        raise CheckpointError(f"{path}: lists {bad[0]!r}, which is not a file inside its directory")
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
    return problems + [f"{directory}: {m}" for m in mixed_shards(manifest)]
