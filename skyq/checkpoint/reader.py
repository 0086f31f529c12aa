"""Read a HF safetensors checkpoint (one file or shards + index), verifying it before use.

`ShardedCheckpoint(dir)` checks, from headers only, that every shard parses (truncated and
corrupt headers are refused naming the file), that the index and the shards agree exactly (no
tensor missing from either side, no shard missing from the index or from disk), that every shard
the index names is a plain file name inside the directory (no `../x` or absolute path, no symlink
out of it), and, when the directory carries a skyq manifest, that every shard's sha256 matches it
(`verify_checksums`): safetensors itself accepts zero-filled and bit-flipped payloads.

`identity` records, before any header is read, what each input shard is on disk (size, mtime,
ctime, inode; plus its sha256 when a verified skyq manifest gives it for free): a converter resumes
an earlier run only when these still match, and refuses to finish when they changed meanwhile.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from skyq.checkpoint.errors import CheckpointError
from skyq.checkpoint.manifest import MANIFEST_NAME, mixed_shards, read_manifest, sha256_file

INDEX_NAME = "model.safetensors.index.json"
SINGLE_FILE_NAME = "model.safetensors"
CONFIG_NAME = "config.json"

DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8,
}  # fmt: skip


@dataclass(frozen=True)
class TensorInfo:
    """What a shard header says about one tensor."""

    name: str
    shard: str
    dtype: str  # safetensors dtype string, e.g. "BF16", "F8_E4M3", "I32"
    shape: tuple[int, ...]
    nbytes: int


def read_header(path: Path) -> dict[str, Any]:
    """Parse a safetensors header after safetensors itself validated the file's structure."""
    try:
        with safe_open(str(path), framework="pt"):
            pass
    except (SafetensorError, OSError) as e:
        raise CheckpointError(
            f"{path}: not a valid safetensors file ({e}); the file is truncated or corrupt - "
            "download or convert it again"
        ) from e
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    header.pop("__metadata__", None)
    return header


def load_json(path: Path) -> dict[str, Any]:
    """A JSON object from `path`, or a CheckpointError naming the file."""
    try:
        obj = json.loads(path.read_text())
    except FileNotFoundError as e:
        raise CheckpointError(f"{path}: file not found") from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: invalid JSON ({e}); the file is truncated or corrupt") from e
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(obj).__name__}")
    return obj


def inside_model_tree(model_dir: Path, path: Path) -> bool:
    """True when `path`, symlinks followed, lies inside `model_dir` (resolved). A Hugging Face cache
    snapshot (`.../snapshots/<rev>/`) links every file into the repo's `blobs/`, which counts too."""
    target = path.resolve()
    if target.is_relative_to(model_dir):
        return True
    return model_dir.parent.name == "snapshots" and target.is_relative_to(model_dir.parent.parent / "blobs")


def check_inside_model_tree(model_dir: Path, path: Path, what: str) -> None:
    """Refuse reading `path` when a symlink takes it out of the model dir: its bytes would be copied
    into the output (a tokenizer link to a private file would leak it into a published checkpoint)."""
    if not inside_model_tree(model_dir, path):
        raise CheckpointError(
            f"{path}: {what} is a symlink to {path.resolve()}, outside the model dir {model_dir}; "
            "copy the file into the model dir instead of linking it"
        )


def _check_shard_name(index_path: Path, tensor: str, shard: object) -> None:
    """A shard named by the index must be a plain `*.safetensors` file name (no folder, no `..`)."""
    if (
        not isinstance(shard, str)
        or not shard.endswith(".safetensors")
        or shard != Path(shard).name
        or "\\" in shard
        or "\0" in shard
    ):
        raise CheckpointError(
            f"{index_path}: weight_map entry {tensor!r} names shard {shard!r}, which is not a plain "
            "*.safetensors file name inside the model dir; fix the index"
        )


def stat_identity(path: Path) -> dict[str, int]:
    """What a file is on disk: any write to it changes ctime (which no user call can set back), a
    replacement changes the inode or ctime."""
    st = os.stat(path)
    return {"bytes": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns, "ino": st.st_ino}


def same_input(recorded: dict[str, Any], current: dict[str, Any]) -> str | None:
    """None when `current` is provably the file `recorded` describes, else how it differs: equal
    stat identity, or (after a copy or a touch) equal sha256 where both sides know it."""
    if recorded.get("bytes") != current["bytes"]:
        return f"size changed from {recorded.get('bytes')} to {current['bytes']} bytes"
    if all(recorded.get(k) == current[k] for k in ("mtime_ns", "ctime_ns", "ino")):
        return None
    if recorded.get("sha256") and current.get("sha256"):
        return None if recorded["sha256"] == current["sha256"] else "its sha256 changed"
    return "it was rewritten, replaced or touched (mtime, ctime or inode changed)"


class ShardedCheckpoint:
    """A verified view of the safetensors checkpoint in `model_dir`."""

    def __init__(self, model_dir: str | Path) -> None:
        self.dir = Path(model_dir).resolve()
        if not self.dir.is_dir():
            raise CheckpointError(f"{self.dir}: model directory not found")
        self.weight_map = self._weight_map()
        for shard in self.shard_names:
            check_inside_model_tree(self.dir, self.dir / shard, "shard")
        self._identity = {shard: stat_identity(self.dir / shard) for shard in self.shard_names}
        self.tensors: dict[str, TensorInfo] = {}
        for shard in self.shard_names:
            self._add_shard(shard)
        missing = sorted(set(self.weight_map) - set(self.tensors))
        if missing:
            raise CheckpointError(
                f"{self.dir / INDEX_NAME}: lists {len(missing)} tensor(s) absent from the shard it names, "
                f"e.g. {missing[0]!r} in {self.weight_map[missing[0]]}; the index or a shard is stale"
            )

    @property
    def shard_names(self) -> list[str]:
        return sorted(set(self.weight_map.values()))

    @property
    def has_index(self) -> bool:
        return (self.dir / INDEX_NAME).exists()

    def _weight_map(self) -> dict[str, str]:
        on_disk = sorted(p.name for p in self.dir.glob("*.safetensors"))
        index_path = self.dir / INDEX_NAME
        if not index_path.exists():
            if on_disk != [SINGLE_FILE_NAME]:
                raise CheckpointError(
                    f"{self.dir}: no {INDEX_NAME} and {len(on_disk)} safetensors file(s) {on_disk[:4]}; "
                    f"a checkpoint is either {SINGLE_FILE_NAME} alone or shards with an index"
                )
            return {name: SINGLE_FILE_NAME for name in read_header(self.dir / SINGLE_FILE_NAME)}
        weight_map = load_json(index_path).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index_path}: no 'weight_map' object")
        for tensor, shard in sorted(weight_map.items(), key=lambda item: str(item[1])):
            _check_shard_name(index_path, tensor, shard)
        for shard in sorted(set(weight_map.values())):
            if not (self.dir / shard).is_file():
                raise CheckpointError(f"{self.dir / shard}: shard named by {index_path} does not exist")
        unindexed = sorted(set(on_disk) - set(weight_map.values()))
        if unindexed:
            raise CheckpointError(
                f"{self.dir / unindexed[0]}: shard is missing from {index_path}; "
                "remove the stray file or regenerate the index"
            )
        return dict(weight_map)

    def _add_shard(self, shard: str) -> None:
        path = self.dir / shard
        for name, entry in read_header(path).items():
            if self.weight_map.get(name) != shard:
                raise CheckpointError(
                    f"{path}: holds tensor {name!r} which the index "
                    f"{'does not list' if name not in self.weight_map else 'places in ' + self.weight_map[name]}"
                )
            start, end = entry["data_offsets"]
            self.tensors[name] = TensorInfo(name, shard, entry["dtype"], tuple(entry["shape"]), end - start)

    def names_in(self, shard: str) -> list[str]:
        """Tensor names of `shard`, sorted."""
        return sorted(n for n, info in self.tensors.items() if info.shard == shard)

    def shard_bytes(self, shard: str) -> int:
        return (self.dir / shard).stat().st_size

    def read_shard(self, shard: str) -> dict[str, torch.Tensor]:
        """Every tensor of `shard` (memory: one shard)."""
        with safe_open(str(self.dir / shard), framework="pt") as f:
            return {name: f.get_tensor(name) for name in self.names_in(shard)}

    def read_tensor(self, name: str) -> torch.Tensor:
        """One tensor, wherever the index puts it (a scale in another shard than its weight)."""
        if name not in self.tensors:
            raise CheckpointError(f"{self.dir}: no tensor {name!r} in any shard")
        with safe_open(str(self.dir / self.tensors[name].shard), framework="pt") as f:
            return f.get_tensor(name)

    def config(self) -> dict[str, Any]:
        """The parsed config.json."""
        return load_json(self.dir / CONFIG_NAME)

    def identity(self) -> dict[str, dict[str, Any]]:
        """Each shard's `stat_identity` as taken when this checkpoint was opened, with its sha256
        once `verify_checksums` has checked it."""
        return {shard: dict(record) for shard, record in self._identity.items()}

    def changed_inputs(self) -> list[str]:
        """Shards whose file is no longer the one opened (each with how it differs)."""
        changed = []
        for shard, record in self._identity.items():
            path = self.dir / shard
            why = same_input(record, stat_identity(path)) if path.is_file() else "it was deleted"
            if why is not None:
                changed.append(f"{path} ({why})")
        return changed

    def verify_checksums(self) -> bool:
        """Check every shard against the directory's skyq manifest, if it has one (True if checked);
        the verified sha256 then joins each shard's `identity`."""
        manifest_path = self.dir / MANIFEST_NAME
        if not manifest_path.exists():
            return False
        manifest = read_manifest(manifest_path)
        recorded = manifest["files"]
        for shard in self.shard_names:
            if shard not in recorded:
                raise CheckpointError(f"{self.dir / shard}: not listed in {manifest_path}")
            sha = sha256_file(self.dir / shard)
            if sha != recorded[shard]["sha256"]:
                raise CheckpointError(
                    f"{self.dir / shard}: sha256 differs from {manifest_path}; the shard is corrupt "
                    "(zero-filled or bit-flipped payload) - copy or convert it again"
                )
            self._identity[shard]["sha256"] = sha
        mixed = mixed_shards(manifest)
        if mixed:
            raise CheckpointError(f"{manifest_path}: {mixed[0]}; convert its source again")
        return True
