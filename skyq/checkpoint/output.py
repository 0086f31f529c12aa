"""A converter's save directory: crash-safe shards, resume from a done-log, index and config last.

Life of a run:
1. `ConversionOutput(...)` refuses a save dir equal to, inside, or containing the model dir, deletes
   temp files a killed run left, and decides what can be kept: shards recorded in the done-log (or
   the manifest of a finished run) of a run with the same fingerprint, re-verified by sha256.
   A save dir holding anything else is refused unless `overwrite` (which deletes our outputs).
2. `write_shard` writes each shard via temp + fsync + rename (hashing the bytes as they are written),
   then appends its sha256 to the fsynced done-log. Every shard is a pure function of the input, so a rerun rewrites identical bytes.
3. `finalize` copies the remaining files, then writes the index, config and manifest, and deletes
   the done-log. A run killed at any moment therefore resumes to byte-identical output.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save as save_safetensors

from skyq.checkpoint import safetensors_stream
from skyq.checkpoint.atomic import (
    atomic_replace,
    atomic_write_bytes,
    atomic_write_chunks,
    atomic_write_json,
    fsync_dir,
    json_bytes,
    remove_stale_temp_files,
)
from skyq.checkpoint.errors import CheckpointError
from skyq.checkpoint.manifest import MANIFEST_NAME, build_manifest, file_record, read_manifest
from skyq.checkpoint.reader import CONFIG_NAME, INDEX_NAME, read_header

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


def fingerprint_of(tool: str, options: dict[str, Any], sources: dict[str, int]) -> str:
    """Identity of a conversion: tool, its options and the input files (names and sizes)."""
    return hashlib.sha256(json_bytes({"tool": tool, "options": options, "sources": sources})).hexdigest()


class ConversionOutput:
    """The save directory of one conversion; see the module docstring for the protocol."""

    def __init__(
        self, *, save_dir: Path, model_dir: Path, tool: str, options: dict[str, Any], sources: dict[str, int],
        overwrite: bool = False,
    ) -> None:  # fmt: skip
        self.dir = Path(save_dir).resolve()
        check_dirs_disjoint(Path(model_dir).resolve(), self.dir)
        self.model_dir = Path(model_dir).resolve()
        self.tool, self.options = tool, options
        self.fingerprint = fingerprint_of(tool, options, sources)
        self.dir.mkdir(parents=True, exist_ok=True)
        remove_stale_temp_files(self.dir)
        self._lock = threading.Lock()
        self.done: dict[str, str] = {}  # shard -> sha256 of a verified, durable output shard
        if overwrite:
            self._delete_previous_outputs()
        self._load_previous_progress()
        atomic_write_bytes(self.dir / DONE_LOG_NAME, self._done_log_bytes())

    @property
    def done_log(self) -> Path:
        return self.dir / DONE_LOG_NAME

    def _delete_previous_outputs(self) -> None:
        for p in self.dir.iterdir():
            if p.suffix == ".safetensors" or p.name in (INDEX_NAME, MANIFEST_NAME, DONE_LOG_NAME):
                p.unlink()

    def _load_previous_progress(self) -> None:
        candidates: dict[str, str] = {}
        if self.done_log.exists():
            records = _read_done_log(self.done_log)
            if records and records[0].get("fingerprint") != self.fingerprint:
                raise CheckpointError(
                    f"{self.done_log}: {self.dir} holds a partial conversion of other inputs or options; "
                    "rerun with the same options, choose an empty save dir, or pass --overwrite"
                )
            candidates = {r["shard"]: r["sha256"] for r in records[1:] if "shard" in r}
        elif (self.dir / MANIFEST_NAME).exists():
            manifest = read_manifest(self.dir / MANIFEST_NAME)
            if manifest.get("fingerprint") != self.fingerprint:
                raise CheckpointError(
                    f"{self.dir / MANIFEST_NAME}: {self.dir} holds a finished conversion of other inputs or "
                    "options; choose an empty save dir or pass --overwrite"
                )
            candidates = {n: r["sha256"] for n, r in manifest["files"].items() if n.endswith(".safetensors")}
        elif any(
            p.suffix == ".safetensors" or p.name in (INDEX_NAME, CONFIG_NAME) for p in self.dir.iterdir()
        ):
            raise CheckpointError(
                f"{self.dir}: not empty and holds no skyq conversion record; choose an empty save dir "
                "or pass --overwrite to replace its checkpoint files"
            )
        for shard, sha in sorted(candidates.items()):
            path = self.dir / shard
            if sha == EMPTY_SHARD:
                path.unlink(missing_ok=True)
                self.done[shard] = sha
            elif path.is_file() and file_record(path)["sha256"] == sha:
                self.done[shard] = sha

    def _done_log_bytes(self) -> bytes:
        lines = [{"fingerprint": self.fingerprint}] + [
            {"shard": s, "sha256": h} for s, h in sorted(self.done.items())
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
        size = atomic_write_chunks(self.dir / shard, chunks, h.update)
        self._record_done(shard, h.hexdigest())
        return size

    def mark_empty(self, shard: str) -> None:
        """Record a shard whose tensors all went elsewhere (e.g. a shard of scales only): done, but
        no file, so no empty shard appears next to the index."""
        self._record_done(shard, EMPTY_SHARD)

    def _record_done(self, shard: str, sha: str) -> None:
        with self._lock:
            self.done[shard] = sha
            # Append + fsync: a torn last line (killed mid-append) is ignored on resume.
            with open(self.done_log, "a") as f:
                f.write(json.dumps({"shard": shard, "sha256": sha}, sort_keys=True) + "\n")
                f.flush()
                os.fsync(f.fileno())

    def copy_file(self, relative: str) -> None:
        """Copy a non-weight file (tokenizer, generation config...) from the model dir, crash-safely."""
        src, dst = self.model_dir / relative, self.dir / relative
        dst.parent.mkdir(parents=True, exist_ok=True)
        with atomic_replace(dst) as tmp:
            shutil.copyfile(src, tmp)
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())

    def finalize(
        self, *, shards: list[str], config: dict[str, Any], extra_json: dict[str, Any], copied: list[str]
    ) -> dict:
        """Write index, extra JSON files (sidecars) and config, then the manifest; returns the index."""
        missing = sorted(set(shards) - set(self.done))
        if missing:
            raise CheckpointError(f"{self.dir}: cannot finalize, shard(s) not converted yet: {missing[:4]}")
        shards = [s for s in shards if self.done[s] != EMPTY_SHARD]
        stray = sorted(p.name for p in self.dir.glob("*.safetensors") if p.name not in shards)
        if stray:
            raise CheckpointError(f"{self.dir / stray[0]}: a shard this conversion did not write; remove it")
        index = build_index(self.dir, shards)
        atomic_write_json(self.dir / INDEX_NAME, index)
        for name, obj in sorted(extra_json.items()):
            atomic_write_json(self.dir / name, obj)
        atomic_write_json(self.dir / CONFIG_NAME, config)
        files = {s: {"sha256": self.done[s], "bytes": (self.dir / s).stat().st_size} for s in shards}
        for name in [INDEX_NAME, CONFIG_NAME, *extra_json, *copied]:
            files[name] = file_record(self.dir / name)
        manifest = build_manifest(
            tool=self.tool, fingerprint=self.fingerprint, options=self.options, files=files
        )
        atomic_write_json(self.dir / MANIFEST_NAME, manifest)
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


def _read_done_log(path: Path) -> list[dict[str, Any]]:
    records = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            break  # a torn final record from a killed append: everything after it is untrusted
    return records
