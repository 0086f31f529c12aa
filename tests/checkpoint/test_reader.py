"""ShardedCheckpoint: finds tensors through the index and refuses broken checkpoints by file name."""

from __future__ import annotations

import json
import time

import pytest
import torch

from checkpoint.tiny_checkpoints import INDEX, write_sharded
from skyq.checkpoint.errors import CheckpointError
from skyq.checkpoint.reader import ShardedCheckpoint, same_input, stat_identity


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"layer.{i}.weight": torch.randn(32, 64, generator=g).bfloat16() for i in range(6)} | {
        f"layer.{i}.weight_scale_inv": torch.rand(1, 1, generator=g) for i in range(6)
    }


def test_reads_every_tensor_and_finds_a_scale_in_another_shard(tmp_path):
    tensors = _tensors(0)
    shards = write_sharded(
        tensors, tmp_path, max_shard_bytes=8192, place=lambda n: "s" if "scale" in n else None
    )
    ckpt = ShardedCheckpoint(tmp_path)
    assert ckpt.shard_names == shards and len(shards) >= 3
    assert ckpt.tensors["layer.0.weight"].shard != ckpt.tensors["layer.0.weight_scale_inv"].shard
    assert torch.equal(ckpt.read_tensor("layer.0.weight_scale_inv"), tensors["layer.0.weight_scale_inv"])
    got = {}
    for shard in ckpt.shard_names:
        got.update(ckpt.read_shard(shard))
    assert got.keys() == tensors.keys() and all(torch.equal(got[k], tensors[k]) for k in tensors)
    assert (
        ckpt.tensors["layer.3.weight"].nbytes == 32 * 64 * 2
        and ckpt.tensors["layer.3.weight"].dtype == "BF16"
    )


@pytest.mark.parametrize("keep", [0, 7, 100, -10])
def test_truncated_shard_is_refused_naming_the_file(tmp_path, keep):
    shards = write_sharded(_tensors(1), tmp_path, max_shard_bytes=8192)
    victim = tmp_path / shards[1]
    data = victim.read_bytes()
    victim.write_bytes(data[:keep] if keep >= 0 else data[:keep])
    with pytest.raises(CheckpointError, match=shards[1]):
        ShardedCheckpoint(tmp_path)


def test_shard_missing_from_index_is_refused(tmp_path):
    shards = write_sharded(_tensors(2), tmp_path, max_shard_bytes=8192)
    index = json.loads((tmp_path / INDEX).read_text())
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v != shards[0]}
    (tmp_path / INDEX).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=f"{shards[0]}: shard is missing from"):
        ShardedCheckpoint(tmp_path)


def test_index_naming_an_absent_shard_is_refused(tmp_path):
    shards = write_sharded(_tensors(3), tmp_path, max_shard_bytes=8192)
    (tmp_path / shards[-1]).unlink()
    with pytest.raises(CheckpointError, match=f"{shards[-1]}: shard named by"):
        ShardedCheckpoint(tmp_path)


def test_tensor_the_index_places_elsewhere_is_refused(tmp_path):
    shards = write_sharded(_tensors(4), tmp_path, max_shard_bytes=8192)
    index = json.loads((tmp_path / INDEX).read_text())
    name = next(k for k, v in index["weight_map"].items() if v == shards[0])
    index["weight_map"][name] = shards[1]
    (tmp_path / INDEX).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=name):
        ShardedCheckpoint(tmp_path)


def test_torn_index_json_is_refused_naming_it(tmp_path):
    write_sharded(_tensors(5), tmp_path, max_shard_bytes=8192)
    text = (tmp_path / INDEX).read_text()
    (tmp_path / INDEX).write_text(text[: len(text) // 2])
    with pytest.raises(CheckpointError, match="index.json: invalid JSON"):
        ShardedCheckpoint(tmp_path)


@pytest.mark.parametrize("entry", ["../x.safetensors", "/tmp/x.safetensors", "sub/x.safetensors", "x.bin", 5])
def test_index_entry_that_is_not_a_plain_shard_file_name_is_refused_naming_it(tmp_path, entry):
    write_sharded(_tensors(0), tmp_path, max_shard_bytes=8192)
    index = json.loads((tmp_path / INDEX).read_text())
    index["weight_map"]["layer.0.weight"] = entry
    (tmp_path / INDEX).write_text(json.dumps(index))
    with pytest.raises(
        CheckpointError, match=f"entry 'layer.0.weight' names shard {entry!r}, which is not a plain"
    ):
        ShardedCheckpoint(tmp_path)


def test_changed_inputs_names_a_rewritten_shard_and_same_input_needs_proof(tmp_path):
    shards = write_sharded(_tensors(0), tmp_path, max_shard_bytes=8192)
    ckpt = ShardedCheckpoint(tmp_path)
    assert ckpt.changed_inputs() == []
    record = ckpt.identity()[shards[1]]
    time.sleep(0.05)  # past the file system's timestamp granularity
    (tmp_path / shards[1]).write_bytes((tmp_path / shards[1]).read_bytes())  # same bytes, rewritten
    assert ckpt.changed_inputs() == [f"{tmp_path / shards[1]} (it was rewritten, replaced or touched "
                                     "(mtime, ctime or inode changed))"]  # fmt: skip
    now = stat_identity(tmp_path / shards[1])
    assert same_input(record, now) is not None
    assert same_input({**record, "sha256": "a"}, {**now, "sha256": "a"}) is None
    assert same_input({**record, "sha256": "a"}, {**now, "sha256": "b"}) == "its sha256 changed"
    assert same_input(record, {**now, "bytes": 1}).startswith("size changed")
