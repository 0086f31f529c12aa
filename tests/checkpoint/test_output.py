"""ConversionOutput: crash-safe shards, done-log resume, index/config/manifest last, refusals."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from checkpoint.tiny_checkpoints import dir_bytes
from skyq.checkpoint import atomic
from skyq.checkpoint.errors import CheckpointError
from skyq.checkpoint.manifest import MANIFEST_NAME, read_manifest, verify_files
from skyq.checkpoint.output import DONE_LOG_NAME, ConversionOutput
from skyq.checkpoint.reader import INDEX_NAME, ShardedCheckpoint


def _shard_tensors(i: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    return {
        f"m.{i}.weight": torch.randn(16, 8, generator=g).bfloat16(),
        f"m.{i}.bias": torch.randn(16, generator=g),
    }


SHARDS = ["a.safetensors", "b.safetensors", "c.safetensors"]
INPUTS = {s: {"bytes": 10, "mtime_ns": 1, "ctime_ns": 1, "ino": i} for i, s in enumerate(SHARDS)}


def _output(tmp_path, options=None, inputs=None, **kw) -> ConversionOutput:
    (tmp_path / "model").mkdir(parents=True, exist_ok=True)
    return ConversionOutput(
        save_dir=tmp_path / "out", model_dir=tmp_path / "model", tool="t", options=options or {"a": 1},
        inputs=inputs or INPUTS, config={"model_type": "x"}, **kw,
    )  # fmt: skip


def _finish(out: ConversionOutput, shards: list[str] = SHARDS) -> dict:
    assert sorted(out.inputs) == sorted(shards)
    return out.finalize()


def test_finished_output_has_byte_total_size_manifest_and_no_done_log(tmp_path):
    out = _output(tmp_path)
    for i, s in enumerate(SHARDS):
        out.write_shard(s, _shard_tensors(i))
    index = _finish(out, SHARDS)
    assert index["metadata"]["total_size"] == 3 * (16 * 8 * 2 + 16 * 4)
    assert not (out.dir / DONE_LOG_NAME).exists()
    manifest = read_manifest(out.dir / MANIFEST_NAME)
    assert set(manifest["files"]) == {*SHARDS, INDEX_NAME, "config.json"}
    assert verify_files(out.dir, manifest) == []
    assert ShardedCheckpoint(out.dir).tensors["m.2.bias"].shard == "c.safetensors"


def test_resume_keeps_verified_shards_and_redoes_a_corrupt_one(tmp_path):
    out = _output(tmp_path)
    out.write_shard(SHARDS[0], _shard_tensors(0))
    out.write_shard(SHARDS[1], _shard_tensors(1))
    (out.dir / SHARDS[1]).write_bytes(b"\0" * (out.dir / SHARDS[1]).stat().st_size)  # zero-filled payload
    with open(out.dir / DONE_LOG_NAME, "a") as f:
        f.write('{"shard": "c.safe')  # torn record of a killed append
    (out.dir / f".a.safetensors{atomic.TEMP_MARKER}123-abc").write_bytes(b"partial")
    resumed = _output(tmp_path)
    assert set(resumed.done) == {SHARDS[0]}
    assert not any(atomic.TEMP_MARKER in p.name for p in resumed.dir.iterdir())


def test_resumed_run_is_byte_identical_to_uninterrupted(tmp_path):
    ref = _output(tmp_path / "ref")
    for i, s in enumerate(SHARDS):
        ref.write_shard(s, _shard_tensors(i))
    _finish(ref, SHARDS)
    first = _output(tmp_path / "run")
    first.write_shard(SHARDS[2], _shard_tensors(2))
    second = _output(tmp_path / "run")
    assert set(second.done) == {SHARDS[2]}
    for i, s in enumerate(SHARDS[:2]):
        second.write_shard(s, _shard_tensors(i))
    _finish(second, SHARDS)
    assert dir_bytes(ref.dir) == dir_bytes(second.dir)
    # A finished run started again keeps everything and finishes identically.
    third = _output(tmp_path / "run")
    assert set(third.done) == set(SHARDS)
    _finish(third, SHARDS)
    assert dir_bytes(ref.dir) == dir_bytes(third.dir)


def test_different_options_on_a_partial_dir_are_refused(tmp_path):
    _output(tmp_path).write_shard(SHARDS[0], _shard_tensors(0))
    with pytest.raises(CheckpointError, match="other options"):
        _output(tmp_path, options={"a": 2})
    again = _output(tmp_path, options={"a": 2}, overwrite=True)
    assert again.done == {}
    again.write_shard(SHARDS[0], _shard_tensors(5))  # replaced in place
    assert set(_output(tmp_path, options={"a": 2}).done) == {SHARDS[0]}


def test_foreign_non_empty_save_dir_is_refused(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / INDEX_NAME).write_text("{}")
    with pytest.raises(CheckpointError, match="not empty"):
        _output(tmp_path)


@pytest.mark.parametrize("save", ["model", "model/sub", "."])
def test_save_dir_overlapping_model_dir_is_refused(tmp_path, save):
    (tmp_path / "model").mkdir()
    with pytest.raises(CheckpointError, match="overlaps the model dir"):
        ConversionOutput(
            save_dir=tmp_path / save, model_dir=tmp_path / "model", tool="t", options={}, inputs=INPUTS,
            config={},
        )  # fmt: skip


def test_failed_write_leaves_no_final_file_and_no_temp(tmp_path, monkeypatch):
    out = _output(tmp_path)

    def disk_full(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", disk_full)
    with pytest.raises(CheckpointError, match="No space left on device.*free space"):
        out.write_shard(SHARDS[0], _shard_tensors(0))
    assert sorted(p.name for p in out.dir.iterdir()) == [DONE_LOG_NAME]
    assert SHARDS[0] not in out.done
    assert "fingerprint" in json.loads((out.dir / DONE_LOG_NAME).read_text().splitlines()[-1])


def test_finalize_refuses_unconverted_shards(tmp_path):
    out = _output(tmp_path)
    out.write_shard(SHARDS[0], _shard_tensors(0))
    with pytest.raises(CheckpointError, match="not converted yet"):
        _finish(out, SHARDS)
    assert not (out.dir / INDEX_NAME).exists() and not (out.dir / "config.json").exists()


def test_obsolete_file_of_an_earlier_conversion_is_never_deleted_through_a_linked_folder(tmp_path):
    (tmp_path / "model" / "sub").mkdir(parents=True)
    (tmp_path / "model" / "sub" / "tok.json").write_text("{}")
    first = _output(tmp_path, copied=["sub/tok.json"])
    for i, s in enumerate(SHARDS):
        first.write_shard(s, _shard_tensors(i))
    _finish(first)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "tok.json").write_text("theirs")
    shutil.rmtree(first.dir / "sub")
    (first.dir / "sub").symlink_to(outside)
    again = _output(tmp_path, overwrite=True)  # copies no sub/tok.json: the recorded one is obsolete
    assert (outside / "tok.json").read_text() == "theirs" and (again.dir / "sub").is_symlink()
