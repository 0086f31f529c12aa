"""The save dir contract: what a converter may resume, replace, refuse, and where it may write."""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from checkpoint.tiny_checkpoints import INDEX, dir_bytes, load_all
from safetensors.torch import load_file, save_file

from skyq.checkpoint import atomic, job, output
from skyq.checkpoint.atomic import TEMP_MARKER
from skyq.checkpoint.manifest import MANIFEST_NAME
from skyq.checkpoint.reader import ShardedCheckpoint
from skyq.tools import convert_fp8_to_bf16, convert_hf_to_fp8, convert_hf_to_int4, inspect
from skyq.tools.cli import run_tool


def _fp8(model: Path, out: Path, *extra: str) -> int:
    return run_tool(convert_hf_to_fp8.main, ["--model-dir", str(model), "--save-dir", str(out), *extra])


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _new_weights(model: Path, seed: int = 1) -> None:
    """Rewrite every shard in place with other values of the same shapes (an RL export landing in
    the same dir)."""
    g = torch.Generator().manual_seed(seed)
    for path in sorted(model.glob("*.safetensors")):
        tensors = {n: (t.float() + torch.randn(t.shape, generator=g) * 1e-2).to(t.dtype) for n, t in
                   load_file(str(path)).items()}  # fmt: skip
        save_file(tensors, str(path), metadata={"format": "pt"})


def _error_line(capsys) -> str:
    """The one `error:` line of stderr (other lines may only be the converters' warnings)."""
    lines = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in lines if not line.startswith("warning: ")]
    assert len(errors) == 1 and errors[0].startswith("error: "), lines
    return errors[0]


def _not_a_checkpoint(out: Path) -> None:
    """Nothing half-written: no temp file, no index/config/manifest, every final-named shard whole."""
    names = {p.name for p in out.rglob("*")}
    assert not any(TEMP_MARKER in n for n in names)
    assert not names & {INDEX, "config.json", MANIFEST_NAME}
    for p in out.glob("*.safetensors"):
        load_file(str(p))


# ---- item 1: --overwrite -----------------------------------------------------------------------


def test_overwrite_of_a_finished_output_converts_again_to_the_same_bytes(
    qwen_bf16, qwen_fp8, tmp_path, capsys
):
    out = _copy(qwen_fp8, tmp_path / "out")
    assert _fp8(qwen_bf16, out, "--overwrite") == 0
    assert "32 shards written (0 already done)" in capsys.readouterr().out
    assert dir_bytes(out) == dir_bytes(qwen_fp8)
    assert _fp8(qwen_bf16, out) == 0  # and a plain rerun resumes it
    assert "0 shards written (32 already done)" in capsys.readouterr().out


def test_foreign_checkpoint_is_refused_untouched_and_replaced_with_overwrite(
    qwen_bf16, qwen_fp8, tmp_path, capsys
):
    out = _copy(qwen_bf16, tmp_path / "out")  # someone's HF checkpoint, same shard names
    (out / "README.md").write_text("their notes\n")
    before = dir_bytes(out)
    assert _fp8(qwen_bf16, out) == 2
    assert "holds no skyq conversion record" in _error_line(capsys) and dir_bytes(out) == before
    assert _fp8(qwen_bf16, out, "--overwrite") == 0
    assert "README.md" in capsys.readouterr().err  # named as left alone
    assert (out / "README.md").read_text() == "their notes\n"
    assert {k: v for k, v in dir_bytes(out).items() if k != "README.md"} == dir_bytes(qwen_fp8)


def test_overwrite_refuses_a_foreign_shard_it_would_leave_before_touching_anything(
    qwen_bf16, tmp_path, capsys
):
    out = tmp_path / "out"
    out.mkdir()
    save_file({"w": torch.ones(2)}, str(out / "model.safetensors"))
    (out / "config.json").write_text("{}")
    before = dir_bytes(out)
    assert _fp8(qwen_bf16, out, "--overwrite") == 2
    assert "model.safetensors: a weight file this conversion does not write" in _error_line(capsys)
    assert dir_bytes(out) == before


def test_overwrite_removes_the_files_of_an_earlier_conversion_it_does_not_write(
    qwen_bf16, kimi_bf16, qwen_fp8, tmp_path
):
    out = tmp_path / "out"
    assert _fp8(kimi_bf16, out) == 0
    assert {p.name for p in out.glob("*.safetensors")} - {p.name for p in qwen_fp8.glob("*.safetensors")}
    assert _fp8(qwen_bf16, out, "--overwrite") == 0
    assert dir_bytes(out) == dir_bytes(qwen_fp8)


# ---- item 2: nothing read or written outside the model dir / save dir ---------------------------


@pytest.mark.parametrize("entry", ["../victim/x.safetensors", "ABSOLUTE"])
def test_index_entry_outside_the_model_dir_is_refused_naming_it(entry, qwen_bf16, tmp_path, capsys):
    model = _copy(qwen_bf16, tmp_path / "m")
    (tmp_path / "victim").mkdir()
    victim = tmp_path / "victim" / "x.safetensors"
    first = sorted(model.glob("*.safetensors"))[0]
    first.rename(victim)
    entry = str(victim) if entry == "ABSOLUTE" else entry
    index = json.loads((model / INDEX).read_text())
    index["weight_map"] = {n: (entry if s == first.name else s) for n, s in index["weight_map"].items()}
    (model / INDEX).write_text(json.dumps(index))
    before = victim.read_bytes()
    # The save dir sits next to the model dir, so `out/../victim/x.safetensors` is the input itself.
    assert _fp8(model, tmp_path / "out") == 2
    err = _error_line(capsys)
    assert repr(entry) in err and "not a plain *.safetensors file name" in err
    assert victim.read_bytes() == before and not (tmp_path / "out").exists()


@pytest.mark.parametrize("link", ["folder", "file"])
def test_symlink_in_the_save_dir_is_refused_even_with_overwrite(link, qwen_bf16, tmp_path, capsys):
    model = _copy(qwen_bf16, tmp_path / "m")
    (model / "extra").mkdir()
    (model / "extra" / "notes.txt").write_text("copied along\n")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "config.json").write_text("theirs\n")
    out = tmp_path / "out"
    out.mkdir()
    if link == "folder":
        (out / "extra").symlink_to(outside)
    else:
        (out / "config.json").symlink_to(outside / "config.json")
    assert _fp8(model, out, "--overwrite") == 2
    assert "a symlink in the save dir" in _error_line(capsys)
    assert sorted(p.name for p in outside.iterdir()) == ["config.json"]
    assert (outside / "config.json").read_text() == "theirs\n"
    assert sorted(p.name for p in out.iterdir()) == [("extra" if link == "folder" else "config.json")]


def test_file_linked_from_outside_the_model_dir_is_refused_but_a_hub_cache_snapshot_is_read(
    qwen_bf16, qwen_fp8, tmp_path, capsys
):
    model = _copy(qwen_bf16, tmp_path / "m")
    secret = tmp_path / "secret.json"
    secret.write_text('{"token": "do not publish"}\n')
    (model / "tokenizer_config.json").unlink()
    (model / "tokenizer_config.json").symlink_to(secret)
    assert _fp8(model, tmp_path / "out") == 2
    assert "tokenizer_config.json: a file to copy is a symlink" in _error_line(capsys)
    assert not (tmp_path / "out").exists()
    # A Hugging Face cache snapshot links every file into the repo's blobs/: that is read.
    repo = tmp_path / "hub" / "models--x--tiny"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    for i, p in enumerate(sorted(qwen_bf16.iterdir())):
        shutil.copyfile(p, repo / "blobs" / f"blob{i}")
        (snapshot / p.name).symlink_to(Path("..", "..", "blobs", f"blob{i}"))
    assert _fp8(snapshot, tmp_path / "from_cache") == 0
    ours, reference = dir_bytes(tmp_path / "from_cache"), dir_bytes(qwen_fp8)
    assert {k: v for k, v in ours.items() if k != MANIFEST_NAME} == {
        k: v for k, v in reference.items() if k != MANIFEST_NAME
    }


# ---- item 3: stale output ----------------------------------------------------------------------


def test_rerun_after_new_weights_of_the_same_shapes_is_refused_then_overwrite_converts_them(
    qwen_bf16, tmp_path, capsys
):
    model = _copy(qwen_bf16, tmp_path / "m")
    out = tmp_path / "out"
    assert _fp8(model, out) == 0
    old = dir_bytes(out)
    _new_weights(model)
    assert _fp8(model, out) == 2
    err = _error_line(capsys)
    assert "conversion of other inputs" in err and "model-00001-of-00032.safetensors" in err
    assert "--overwrite" in err and dir_bytes(out) == old
    assert inspect.main([str(out), "--verify"]) == 0  # the old output itself is sound
    capsys.readouterr()
    assert _fp8(model, out, "--overwrite") == 0
    assert _fp8(model, tmp_path / "fresh") == 0
    assert dir_bytes(out) == dir_bytes(tmp_path / "fresh")


def test_another_model_of_the_same_shapes_into_a_used_save_dir_is_refused(
    qwen_bf16, qwen_fp8, tmp_path, capsys
):
    other = _copy(qwen_bf16, tmp_path / "other")
    _new_weights(other, seed=7)
    out = _copy(qwen_fp8, tmp_path / "out")
    before = dir_bytes(out)
    assert _fp8(other, out) == 2
    assert "finished conversion of other inputs" in _error_line(capsys)
    assert dir_bytes(out) == before


def test_disk_full_is_one_error_line_and_a_resume_after_the_input_changed_is_refused(
    qwen_bf16, tmp_path, capsys, monkeypatch
):
    """Disk full is simulated: no small tmpfs here, so the shard writer's chunks raise
    OSError(ENOSPC) from the 4th shard on, after the first chunk reached the temp file."""
    model = _copy(qwen_bf16, tmp_path / "m")
    out = tmp_path / "out"
    real_write, calls = output.atomic_write_chunks, []

    def filling_disk(path, chunks, on_chunk=None):
        calls.append(path)

        def failing():
            for i, chunk in enumerate(chunks):
                if i and len(calls) >= 4:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                yield chunk

        return real_write(path, failing(), on_chunk)

    monkeypatch.setattr(output, "atomic_write_chunks", filling_disk)
    assert _fp8(model, out) == 2
    err = _error_line(capsys)
    assert "No space left on device" in err and "free space there or choose another --save-dir" in err
    _not_a_checkpoint(out)
    monkeypatch.undo()
    # The killed/failed run's input changes before the resume: refused, never mixed.
    _new_weights(model)
    assert _fp8(model, out) == 2
    assert "partial conversion of other inputs" in _error_line(capsys)
    assert _fp8(model, out, "--overwrite") == 0
    assert _fp8(model, tmp_path / "fresh") == 0
    assert dir_bytes(out) == dir_bytes(tmp_path / "fresh")


def test_input_changed_while_converting_is_left_unfinished(qwen_bf16, tmp_path, capsys, monkeypatch):
    model = _copy(qwen_bf16, tmp_path / "m")
    real_run = job.run_conversion

    def export_lands_meanwhile(**kw):
        stats = real_run(**kw)
        _new_weights(model)
        return stats

    monkeypatch.setattr(job, "run_conversion", export_lands_meanwhile)
    assert _fp8(model, tmp_path / "out") == 2
    assert "changed while it was being converted" in _error_line(capsys)
    _not_a_checkpoint(tmp_path / "out")


def test_a_copied_skyq_input_resumes_by_its_manifest_sha256(qwen_fp8, tmp_path, capsys):
    """Stat identity differs after a copy; the input's verified manifest proves the bytes equal."""
    first = _copy(qwen_fp8, tmp_path / "a")
    out = tmp_path / "bf16"
    assert run_tool(convert_fp8_to_bf16.main, ["--model-dir", str(first), "--save-dir", str(out)]) == 0
    second = _copy(first, tmp_path / "b")
    capsys.readouterr()
    assert run_tool(convert_fp8_to_bf16.main, ["--model-dir", str(second), "--save-dir", str(out)]) == 0
    assert "0 shards written" in capsys.readouterr().out


def test_inspect_verify_flags_a_shard_spliced_in_from_another_conversion(
    qwen_bf16, qwen_fp8, tmp_path, capsys
):
    other_model = _copy(qwen_bf16, tmp_path / "other")
    _new_weights(other_model)
    other = tmp_path / "other_fp8"
    assert _fp8(other_model, other) == 0
    mixed = _copy(qwen_fp8, tmp_path / "mixed")
    shard = sorted(p.name for p in mixed.glob("*.safetensors"))[5]
    shutil.copyfile(other / shard, mixed / shard)  # the bytes and record of the other conversion
    manifest = json.loads((mixed / MANIFEST_NAME).read_text())
    manifest["files"][shard] = json.loads((other / MANIFEST_NAME).read_text())["files"][shard]
    (mixed / MANIFEST_NAME).write_text(json.dumps(manifest))
    capsys.readouterr()
    assert inspect.main([str(mixed), "--verify"]) == 1
    assert f"{shard} was converted from other inputs" in capsys.readouterr().out
    assert (
        run_tool(convert_fp8_to_bf16.main, ["--model-dir", str(mixed), "--save-dir", str(tmp_path / "o")])
        == 2
    )
    assert "mixes two conversions" in _error_line(capsys)


# ---- item 6: bad save dirs and flags -------------------------------------------------------------


def test_save_dir_holding_unrelated_files_is_refused_untouched(qwen_bf16, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine\n")
    assert _fp8(qwen_bf16, out) == 2
    assert "not empty (notes.txt) and holds no skyq conversion record" in _error_line(capsys)
    assert [p.name for p in out.iterdir()] == ["notes.txt"]


@pytest.mark.parametrize("where", ["file", "under_a_file"])
def test_save_dir_that_is_a_file_is_refused(where, qwen_bf16, tmp_path, capsys):
    target = tmp_path / "f"
    target.write_text("x")
    assert _fp8(qwen_bf16, target if where == "file" else target / "sub") == 2
    assert f"{target} is a file, not a directory" in _error_line(capsys)
    assert target.read_text() == "x"


def test_read_only_save_dir_is_one_error_line(qwen_bf16, tmp_path, capsys, monkeypatch):
    """Simulated: tests run as root, which ignores permission bits, so the first file the converter
    creates in the save dir fails with EROFS as on a read-only mount."""
    out = tmp_path / "out"
    out.mkdir()

    def read_only(path, *args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))

    monkeypatch.setattr(atomic, "open", read_only, raising=False)
    assert _fp8(qwen_bf16, out) == 2
    err = _error_line(capsys)
    assert "Read-only file system" in err and "choose a --save-dir you can write to" in err
    assert list(out.iterdir()) == []


@pytest.mark.parametrize(
    ("main", "args", "flag"),
    [
        (convert_hf_to_fp8.main, ["--block-size", "0", "0"], "--block-size"),
        (convert_hf_to_fp8.main, ["--block-size", "-1", "128"], "--block-size"),
        (convert_hf_to_fp8.main, ["--max-workers", "-3"], "--max-workers"),
        (convert_hf_to_int4.main, ["--group-size", "0"], "--group-size"),
        (convert_fp8_to_bf16.main, ["--max-workers", "0"], "--max-workers"),
    ],
)
def test_non_positive_size_flags_are_one_error_line(main, args, flag, qwen_bf16, tmp_path, capsys):
    assert run_tool(main, ["--model-dir", str(qwen_bf16), "--save-dir", str(tmp_path / "out"), *args]) == 2
    err = _error_line(capsys)
    assert f"argument {flag}: expected a positive integer" in err and "--help" in err
    assert not (tmp_path / "out").exists()


def test_reader_refuses_a_shard_linked_from_outside_the_model_dir(qwen_bf16, tmp_path):
    model = _copy(qwen_bf16, tmp_path / "m")
    shard = sorted(model.glob("*.safetensors"))[2]
    shard.rename(tmp_path / "elsewhere.safetensors")
    shard.symlink_to(tmp_path / "elsewhere.safetensors")
    with pytest.raises(ValueError, match="shard is a symlink to .*outside the model dir"):
        ShardedCheckpoint(model)
    assert load_all(qwen_bf16).keys()  # the fixture itself is untouched
