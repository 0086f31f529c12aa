"""A converter's save directory: crash-safe shards, resume from a done-log, index and config last.

Life of a run:
1. `ConversionOutput(...)` decides whether the save dir may be used before it touches anything. It
   refuses a save dir equal to, inside or containing the model dir, a path that is a file, and a
   symlink on any path the conversion writes (outputs are created only inside the save dir). A dir
   holding a skyq conversion record (the done-log of a partial run, the manifest of a finished one)
   is resumed only when the tool, options, config and every input shard are provably the same
   (`reader.same_input`), else refused with the reason; a dir holding anything else is refused.
   With `overwrite` nothing is resumed: each file the conversion writes is replaced by an atomic
   rename, files an earlier skyq conversion recorded and this one does not write are removed, any
   other file is left as it is, and a weight file that would be left as a stray shard is refused.
   Then it deletes temp files a killed run left, writes the done-log's header (the dir is now a
   partial run of this conversion) and, with `overwrite`, removes the old manifest and index, so no
   reader takes the dir for a finished checkpoint while its shards are being replaced.
2. `write_shard` writes each shard via temp + fsync + rename (hashing the bytes as they are written),
   then appends its sha256 to the fsynced done-log. Every shard is a pure function of the input, so a
   rerun rewrites identical bytes.
3. `finalize` copies the non-weight files, then writes the index, config and manifest, and deletes
   the done-log. A run killed at any moment therefore resumes to byte-identical output.

A failed write (disk full, read-only file system) becomes a `CheckpointError` naming the file, the
cause and the fix; the temp file is removed and finished shards stay recorded for the next run.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save as save_safetensors

from skyq.checkpoint import safetensors_stream
from skyq.checkpoint.atomic import (
    TEMP_MARKER,
    atomic_replace,
    atomic_write_bytes,
    atomic_write_chunks,
    atomic_write_json,
    fsync_dir,
    json_bytes,
    remove_stale_temp_files,
)
from skyq.checkpoint.errors import CheckpointError
from skyq.checkpoint.manifest import (
    MANIFEST_NAME,
    build_manifest,
    file_record,
    is_plain_relative,
    read_manifest,
)
from skyq.checkpoint.reader import CONFIG_NAME, INDEX_NAME, read_header, same_input

DONE_LOG_NAME = ".skyq_done.jsonl"
EMPTY_SHARD = "empty"  # done-log / `done` marker of an input shard that yields no output shard
# Fixed header metadata: the same tensors always serialize to the same bytes.
SHARD_METADATA = {"format": "pt"}


def check_dirs_disjoint(model_dir: Path, save_dir: Path) -> None:
    """Refuse a save dir that is, or is inside, or contains the model dir (writes could clobber it)."""
    if save_dir == model_dir or save_dir.is_relative_to(model_dir) or model_dir.is_relative_to(save_dir):
        raise CheckpointError(
            f"save dir {save_dir} overlaps the model dir {model_dir}; choose a directory outside it "
            "(a converter must never write over or next to its own input)"
        )


def fingerprint_of(
    tool: str, options: dict[str, Any], shards: list[str], config: dict[str, Any], extra_json: dict[str, Any]
) -> str:
    """Identity of a conversion apart from its input bytes: tool, options, input shard names and
    the JSON files it writes (config.json follows the source config, which decides what is quantized)."""
    return hashlib.sha256(
        json_bytes(
            {
                "tool": tool,
                "options": options,
                "shards": sorted(shards),
                "config": config,
                "extra": extra_json,
            }
        )
    ).hexdigest()


def write_failed(path: Path, e: OSError) -> CheckpointError:
    """One line naming the file, the cause and the fix of a failed write."""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        fix = "free space there or choose another --save-dir, then run the same command again"
    elif e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        fix = "choose a --save-dir you can write to"
    else:
        fix = "fix the cause, then run the same command again"
    return CheckpointError(f"{path}: cannot write ({e.strerror or e}); {fix}")


@contextmanager
def writing(path: Path) -> Iterator[None]:
    """Turn an OSError of the body (a write to `path`) into `write_failed`'s CheckpointError."""
    try:
        yield
    except OSError as e:
        raise write_failed(path, e) from e


@dataclass(frozen=True)
class _Previous:
    """What an earlier conversion recorded in the save dir."""

    path: Path
    kind: str  # "partial" (done-log) or "finished" (manifest)
    fingerprint: str | None
    inputs: dict[str, dict[str, Any]] | None
    inputs_id: str | None
    files: frozenset[str]
    """Every file it wrote (or was writing), relative to the save dir."""
    shards: dict[str, str]
    """shard -> sha256 (or EMPTY_SHARD) of the shards it finished."""


class ConversionOutput:
    """The save directory of one conversion; see the module docstring for the protocol.

    `inputs` maps each input shard to its identity (`ShardedCheckpoint.identity`); each input shard
    yields the output shard of the same name. `copied`: the model dir's non-weight files to copy."""

    def __init__(
        self, *, save_dir: Path, model_dir: Path, tool: str, options: dict[str, Any],
        inputs: dict[str, dict[str, Any]], config: dict[str, Any], extra_json: dict[str, Any] | None = None,
        copied: list[str] | None = None, overwrite: bool = False,
    ) -> None:  # fmt: skip
        self.dir = Path(save_dir).resolve()
        self.model_dir = Path(model_dir).resolve()
        check_dirs_disjoint(self.model_dir, self.dir)
        self.tool, self.options, self.config = tool, options, config
        self.extra_json, self.copied = dict(extra_json or {}), list(copied or [])
        self.inputs = {shard: dict(record) for shard, record in sorted(inputs.items())}
        self.fingerprint = fingerprint_of(tool, options, list(self.inputs), config, self.extra_json)
        self.writes = frozenset(
            {
                *self.inputs,
                INDEX_NAME,
                CONFIG_NAME,
                MANIFEST_NAME,
                DONE_LOG_NAME,
                *self.extra_json,
                *self.copied,
            }
        )
        self._lock = threading.Lock()
        self.done: dict[str, str] = {}  # shard -> sha256 of a verified, durable output shard

        # Decide, touching nothing.
        blocking = next((p for p in [self.dir, *self.dir.parents] if p.exists() and not p.is_dir()), None)
        if blocking is not None:
            raise CheckpointError(
                f"--save-dir {self.dir}: {blocking} is a file, not a directory; choose a new or an empty directory"
            )
        for rel in sorted(self.writes):
            self._check_target(rel)
        present = self._present_files()
        if overwrite:
            try:
                previous = self._previous()
            except CheckpointError:
                previous = None  # an unreadable record of ours is replaced like the rest
            self._check_overwrite(present, previous)
            candidates: dict[str, str] = {}
            self.inputs_id = self._inputs_id()
        else:
            previous = self._previous()
            candidates = self._check_resume(present, previous)
            self.inputs_id = previous.inputs_id if previous is not None else self._inputs_id()
        # Files an earlier skyq conversion here wrote and this one does not (e.g. an old shard
        # name, a tokenizer file the model dir no longer has): removed once the dir is ours.
        recorded = previous.files if previous is not None else frozenset()
        obsolete = sorted(f for f in recorded if f not in self.writes and f in present)  # links not followed

        # Use the dir.
        with writing(self.dir):
            self.dir.mkdir(parents=True, exist_ok=True)
        remove_stale_temp_files(self.dir)
        self._keep_verified(candidates)
        with writing(self.done_log):
            atomic_write_bytes(self.done_log, self._done_log_bytes())
        with writing(self.dir):
            for rel in [MANIFEST_NAME, INDEX_NAME] if overwrite else []:
                (self.dir / rel).unlink(missing_ok=True)
            for rel in obsolete:
                (self.dir / rel).unlink()
            fsync_dir(self.dir)
        left = sorted(set(present) - self.writes - recorded)
        if left:
            print(f"{tool}: left as they are (not written by this conversion): {', '.join(left[:8])}"
                  + (f" and {len(left) - 8} more" if len(left) > 8 else ""), file=sys.stderr)  # fmt: skip

    @property
    def done_log(self) -> Path:
        return self.dir / DONE_LOG_NAME

    def _inputs_id(self) -> str:
        return hashlib.sha256(
            json_bytes({"fingerprint": self.fingerprint, "inputs": self.inputs})
        ).hexdigest()

    def _check_target(self, rel: str) -> None:
        """Every existing component of a path the conversion writes must be a real folder (the
        file itself: a regular file): a symlink would send the write outside the save dir."""
        path = self.dir
        parts = Path(rel).parts
        for i, part in enumerate(parts):
            path = path / part
            if path.is_symlink():
                raise CheckpointError(
                    f"{path}: a symlink in the save dir (to {os.readlink(path)}); the converter writes only "
                    "inside --save-dir and never through a link: remove the link or choose another --save-dir"
                )
            last = i == len(parts) - 1
            if path.exists() and (path.is_dir() if last else not path.is_dir()):
                kind = "folder" if last else "file"
                raise CheckpointError(
                    f"{path}: a {kind} where the conversion writes {'a file' if last else 'into a folder'}; "
                    "remove it or choose another --save-dir"
                )

    def _present_files(self) -> list[str]:
        """Every file or link in the save dir (not real folders, not temp files), relative."""
        if not self.dir.is_dir():
            return []
        return sorted(
            p.relative_to(self.dir).as_posix()
            for p in self.dir.rglob("*")
            if (p.is_symlink() or not p.is_dir()) and TEMP_MARKER not in p.name
        )

    def _previous(self) -> _Previous | None:
        """The done-log of a partial run, else the manifest of a finished one, else None."""
        if self.done_log.is_file():
            records = _read_done_log(self.done_log)
            header = records[0] if records and isinstance(records[0], dict) else {}
            shards = {
                r["shard"]: r["sha256"]
                for r in records[1:]
                if isinstance(r, dict) and "shard" in r and r.get("inputs_id") == header.get("inputs_id")
            }
            path, kind, files = self.done_log, "partial", {*shards, DONE_LOG_NAME}
        elif (self.dir / MANIFEST_NAME).is_file():
            header = read_manifest(self.dir / MANIFEST_NAME)
            shards = {n: r["sha256"] for n, r in header["files"].items() if n.endswith(".safetensors")}
            path, kind, files = self.dir / MANIFEST_NAME, "finished", {*header["files"], MANIFEST_NAME}
        else:
            return None
        bad = [name for name in files if not is_plain_relative(name)]
        if bad:
            raise CheckpointError(f"{path}: names {bad[0]!r}, which is not a file inside {self.dir}")
        inputs = header.get("inputs")
        return _Previous(
            path=path, kind=kind, fingerprint=header.get("fingerprint"),
            inputs=inputs if isinstance(inputs, dict) else None, inputs_id=header.get("inputs_id"),
            files=frozenset(files), shards=shards,
        )  # fmt: skip

    def _check_resume(self, present: list[str], previous: _Previous | None) -> dict[str, str]:
        """Shards an earlier run of this very conversion finished, or a CheckpointError saying why
        the save dir cannot be used."""
        overwrite = "pass --overwrite to convert again (it replaces the files this conversion writes)"
        if previous is None:
            if present:
                more = f" and {len(present) - 1} more" if len(present) > 1 else ""
                raise CheckpointError(
                    f"{self.dir}: not empty ({present[0]}{more}) and holds no skyq conversion record; "
                    f"choose an empty --save-dir, or {overwrite}"
                )
            return {}
        where = f"{previous.path}: {self.dir} holds a {previous.kind} conversion"
        if previous.inputs is None or previous.inputs_id is None:
            raise CheckpointError(f"{where} that did not record its inputs (an older skyq); {overwrite}")
        if previous.fingerprint != self.fingerprint:
            raise CheckpointError(
                f"{where} with another tool, other options, input shards or config; rerun with the same "
                f"options, choose an empty --save-dir, or {overwrite}"
            )
        for shard, record in self.inputs.items():
            why = same_input(previous.inputs.get(shard, {}), record)
            if why is not None:
                raise CheckpointError(
                    f"{where} of other inputs: {self.model_dir / shard} differs from the file it was "
                    f"converted from ({why}); {overwrite}, or choose another --save-dir"
                )
        unknown = [f for f in present if f not in self.writes and f not in previous.files]
        if unknown:
            raise CheckpointError(
                f"{self.dir / unknown[0]}: not written by this conversion; remove it or choose another --save-dir"
            )
        return previous.shards

    def _check_overwrite(self, present: list[str], previous: _Previous | None) -> None:
        """Refuse a foreign weight file that would be left next to the new shards."""
        recorded = previous.files if previous is not None else frozenset()
        stray = [
            f
            for f in present
            if f.endswith(".safetensors") and "/" not in f and f not in self.writes | recorded
        ]
        if stray:
            raise CheckpointError(
                f"{self.dir / stray[0]}: a weight file this conversion does not write (another checkpoint's?); "
                "--overwrite replaces only the files the conversion writes: remove it or choose another --save-dir"
            )

    def _keep_verified(self, candidates: dict[str, str]) -> None:
        for shard, sha in sorted(candidates.items()):
            if shard not in self.inputs:
                continue
            path = self.dir / shard
            if sha == EMPTY_SHARD:
                with writing(path):
                    path.unlink(missing_ok=True)
                self.done[shard] = sha
            elif path.is_file() and file_record(path)["sha256"] == sha:
                self.done[shard] = sha

    def _done_log_bytes(self) -> bytes:
        header = {"fingerprint": self.fingerprint, "inputs": self.inputs, "inputs_id": self.inputs_id}
        lines = [header] + [
            {"inputs_id": self.inputs_id, "sha256": h, "shard": s} for s, h in sorted(self.done.items())
        ]
        return "".join(json.dumps(r, sort_keys=True) + "\n" for r in lines).encode()

    def write_shard(self, shard: str, tensors: dict[str, torch.Tensor]) -> int:
        """Write one output shard crash-safely and record it as done; returns its size in bytes.

        The bytes are those of `safetensors.torch.save(tensors, SHARD_METADATA)`, streamed from the
        tensors' memory and hashed while they are written (no serialized copy of the shard)."""
        if not tensors:
            raise CheckpointError(f"{shard}: refusing to write a shard with no tensors")
        if safetensors_stream.supports(tensors):
            chunks = safetensors_stream.chunks(tensors, SHARD_METADATA)
        else:  # a dtype the stream does not rank (e.g. U16): safetensors serializes it
            chunks = [
                save_safetensors({k: v.contiguous() for k, v in tensors.items()}, metadata=SHARD_METADATA)
            ]
        h = hashlib.sha256()
        path = self._target(shard)
        with writing(path):
            size = atomic_write_chunks(path, chunks, h.update)
        self._record_done(shard, h.hexdigest())
        return size

    def mark_empty(self, shard: str) -> None:
        """Record a shard whose tensors all went elsewhere (e.g. a shard of scales only): done, but
        no file (a file of that name, which this conversion would have written, is removed), so no
        empty shard appears next to the index."""
        path = self._target(shard)
        with writing(path):
            path.unlink(missing_ok=True)
        self._record_done(shard, EMPTY_SHARD)

    def _record_done(self, shard: str, sha: str) -> None:
        with self._lock, writing(self.done_log):
            self.done[shard] = sha
            # Append + fsync: a torn last line (killed mid-append) is ignored on resume.
            with open(self.done_log, "a") as f:
                f.write(
                    json.dumps({"inputs_id": self.inputs_id, "sha256": sha, "shard": shard}, sort_keys=True)
                )
                f.write("\n")
                f.flush()
                os.fsync(f.fileno())

    def _target(self, rel: str) -> Path:
        """The path of a file this conversion writes, re-checked for links planted since the start."""
        if rel not in self.writes:
            raise CheckpointError(f"{self.dir / rel}: not a file this conversion writes")
        self._check_target(rel)
        return self.dir / rel

    def _write_json(self, rel: str, obj: Any) -> None:
        path = self._target(rel)
        with writing(path):
            atomic_write_json(path, obj)

    def _copy_file(self, relative: str) -> None:
        """Copy a non-weight file (tokenizer, generation config...) from the model dir, crash-safely."""
        src, dst = self.model_dir / relative, self._target(relative)
        with writing(dst):
            dst.parent.mkdir(parents=True, exist_ok=True)
            with atomic_replace(dst) as tmp:
                shutil.copyfile(src, tmp)
                with open(tmp, "rb+") as f:
                    os.fsync(f.fileno())

    def finalize(self) -> dict:
        """Copy the non-weight files, write the index, the extra JSON files (sidecars) and config,
        then the manifest; returns the index."""
        shards = list(self.inputs)
        missing = [s for s in shards if s not in self.done]
        if missing:
            raise CheckpointError(f"{self.dir}: cannot finalize, shard(s) not converted yet: {missing[:4]}")
        shards = [s for s in shards if self.done[s] != EMPTY_SHARD]
        stray = sorted(p.name for p in self.dir.glob("*.safetensors") if p.name not in shards)
        if stray:
            raise CheckpointError(f"{self.dir / stray[0]}: a shard this conversion did not write; remove it")
        for rel in self.copied:
            self._copy_file(rel)
        index = build_index(self.dir, shards)
        self._write_json(INDEX_NAME, index)
        for name, obj in sorted(self.extra_json.items()):
            self._write_json(name, obj)
        self._write_json(CONFIG_NAME, self.config)
        files = {
            s: {"sha256": self.done[s], "bytes": (self.dir / s).stat().st_size, "inputs_id": self.inputs_id}
            for s in shards
        }
        for name in [INDEX_NAME, CONFIG_NAME, *self.extra_json, *self.copied]:
            files[name] = file_record(self.dir / name)
        manifest = build_manifest(
            tool=self.tool, fingerprint=self.fingerprint, options=self.options, files=files,
            inputs=self.inputs, inputs_id=self.inputs_id,
        )  # fmt: skip
        self._write_json(MANIFEST_NAME, manifest)
        with writing(self.dir):
            self.done_log.unlink(missing_ok=True)
            fsync_dir(self.dir)
        return index


def build_index(directory: Path, shards: list[str]) -> dict[str, Any]:
    """HF index of `shards`: sorted weight_map and `total_size` = total BYTES of tensor data."""
    weight_map, total = {}, 0
    for shard in sorted(shards):
        for name, entry in read_header(directory / shard).items():
            weight_map[name] = shard
            start, end = entry["data_offsets"]
            total += end - start
    return {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}


def _read_done_log(path: Path) -> list[Any]:
    records = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            break  # a torn final record from a killed append: everything after it is untrusted
    return records
