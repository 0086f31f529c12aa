"""The command-line entry points, run as a user runs them (subprocesses)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(*args, cwd=ROOT):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=cwd, timeout=300)


def test_train_help_explains_groups_and_options():
    out = _run("-m", "skyq.train", "--help")
    assert out.returncode == 0
    for word in ("precision:", "fp8_blockwise", "model:", "qwen3_30b", "topology:", "dry_run=true", "recipe"):
        assert word in out.stdout, word


def test_dry_run_of_a_gpu_recipe_prints_the_plan_and_exits_0(tmp_path):
    out = _run(
        "-m",
        "skyq.train",
        "precision=mxfp8",
        "model=qwen3_30b",
        "topology=8gpu",
        "trainer=megatron",
        "rollout=vllm",
        "dry_run=true",
        f"output_root={tmp_path}",
    )
    assert out.returncode == 0, out.stderr
    assert "routed_expert" in out.stdout and "bytes per weight sync" in out.stdout
    assert "TP1 PP1 CP1 DP8 EP8" in out.stdout
    assert list(tmp_path.iterdir()) == []  # a dry run leaves no run directory


def test_gpu_topology_without_gpus_says_what_is_missing_and_mentions_dry_run(tmp_path):
    out = _run(
        "-m", "skyq.train", "precision=mxfp8", "model=small_moe", "topology=2gpu", f"output_root={tmp_path}"
    )
    assert out.returncode != 0
    assert "needs 2 CUDA GPUs" in out.stderr and "dry_run=true" in out.stderr


def test_invalid_config_exits_nonzero_naming_the_key(tmp_path):
    out = _run(
        "-m",
        "skyq.train",
        "precision=mxfp8",
        "precision.persistent_fp8_params=true",
        "dry_run=true",
        f"output_root={tmp_path}",
    )
    assert out.returncode == 2 and "precision.persistent_fp8_params" in out.stderr


def test_config_ls_show_validate(tmp_path):
    ls = _run("-m", "skyq.config", "ls")
    assert ls.returncode == 0 and "kimi_k26_int4_qat_256gpu_text" in ls.stdout and "int4_qat" in ls.stdout
    show = _run("-m", "skyq.config", "show", "model=qwen3_30b", "precision=int4_qat")
    assert show.returncode == 0 and "moe_intermediate_size: 768" in show.stdout
    recipe = tmp_path / "mine.yaml"
    ok = _run("-m", "skyq.config", "cp", "qwen3_30b_int4_qat_8gpu", str(recipe))
    assert ok.returncode == 0
    assert _run("-m", "skyq.config", "validate", str(recipe)).returncode == 0
    recipe.write_text(recipe.read_text().replace("int4_group_size: 128", "int4_group_size: 100"))
    bad = _run("-m", "skyq.config", "validate", str(recipe))
    assert bad.returncode == 2 and "precision.int4_group_size" in bad.stderr


def test_a_model_the_embedded_pair_cannot_hold_is_refused_dry_run_or_not(tmp_path):
    """The dry run printed a plan for a 30B model on the embedded pair (which holds all of it on one
    device per side); both the run and the dry run now refuse it with the numbers."""
    for extra in ([], ["dry_run=true"]):
        out = _run("-m", "skyq.train", "model=qwen3_30b", "topology=2gpu", *extra, f"output_root={tmp_path}")
        assert out.returncode == 2 and "30.5B parameters" in out.stderr and "GB" in out.stderr, out.stderr
    kimi = _run("-m", "skyq.train", "model=kimi_k26", "topology=1gpu", f"output_root={tmp_path}")
    assert kimi.returncode == 2 and "1026.9B parameters" in kimi.stderr
    assert list(tmp_path.iterdir()) == []


def test_the_embedded_dry_run_shows_one_trainer_rank_and_an_engine_per_gpu(tmp_path):
    out = _run(
        "-m",
        "skyq.train",
        "topology=8gpu",
        "topology.parallel.ep=1",
        "dry_run=true",
        f"output_root={tmp_path}",
    )
    assert out.returncode == 0, out.stderr
    assert "trainer: 1 rank(s) TP1 PP1 CP1 DP1" in out.stdout and "DP8" not in out.stdout
    assert "rollout: 8 embedded engine(s) x 1 GPU, 0.2 GPU each" in out.stdout


def test_hydra_level_errors_are_one_line_exit_2(tmp_path):
    """`output_root=${nope}` was Hydra's traceback (its formatter even failed), a missing group option a
    multi-line message; both now one `error:` line and exit 2, no run directory."""
    out = _run("-m", "skyq.train", "output_root=${nope}", "dry_run=true", cwd=tmp_path)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.strip().splitlines() == [
        "error: config key `hydra.run.dir` (made from output_root): Interpolation key 'nope' not found"
    ]
    out = _run("-m", "skyq.train", "precision=nope", f"output_root={tmp_path}")
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1
    assert "Could not find 'precision/nope'" in out.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_run_dir_holding_someone_elses_files_is_refused(tmp_path):
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "thesis.tex").write_text("keep me")
    out = _run("-m", "skyq.train", f"hydra.run.dir={foreign}", "dry_run=true")
    assert out.returncode == 2, out.stderr
    assert f"hydra.run.dir={foreign} is not empty (holds thesis.tex)" in out.stderr
    assert [p.name for p in foreign.iterdir()] == ["thesis.tex"]


def test_config_cp_into_a_folder_that_does_not_exist_creates_it(tmp_path):
    dest = tmp_path / "new" / "folder" / "mine.yaml"
    out = _run("-m", "skyq.config", "cp", "tiny_moe_fp8_blockwise_cpu", str(dest))
    assert out.returncode == 0 and dest.is_file(), out.stderr
    into = _run("-m", "skyq.config", "cp", "tiny_moe_fp8_blockwise_cpu", str(dest.parent))
    assert into.returncode == 0 and (dest.parent / "tiny_moe_fp8_blockwise_cpu.yaml").is_file()
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    bad = _run("-m", "skyq.config", "cp", "tiny_moe_fp8_blockwise_cpu", str(blocker / "x.yaml"))
    assert (
        bad.returncode == 2 and bad.stderr.startswith("error: cannot write") and "Traceback" not in bad.stderr
    )


def test_dry_run_says_what_the_trainer_computes_in(tmp_path):
    for dtype, needle in (("bf16", "the rollout engine's activation dtype"), ("fp32", "expect a larger")):
        out = _run(
            "-m", "skyq.train", "dry_run=true", f"trainer.compute_dtype={dtype}", f"output_root={tmp_path}"
        )
        assert out.returncode == 0, out.stderr
        line = next(x for x in out.stdout.splitlines() if x.startswith("trainer numerics:"))
        assert f"forward/backward in {dtype}," in line and needle in line


def test_a_value_out_of_range_stops_the_command_before_any_run_directory(tmp_path):
    """`algorithm.num_steps=-1` used to run an empty run (exit 0); now the command exits 2 naming the key
    and its range, and writes no run directory."""
    out = _run("-m", "skyq.train", "algorithm.num_steps=-1", "rollout.top_p=2", f"output_root={tmp_path}")
    assert out.returncode == 2, out.stderr
    assert (
        "algorithm.num_steps=-1 must be >= 1" in out.stderr
        and "rollout.top_p=2.0 must be in (0, 1]" in out.stderr
    )
    assert list(tmp_path.iterdir()) == []


def test_an_output_root_no_run_directory_can_be_made_in_is_one_line_exit_2(tmp_path):
    """Was Hydra's traceback of its run-directory creation (exit 1); now `error: output_root=...` with the
    OS's reason, exit 2, as every config error."""
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    out = _run("-m", "skyq.train", f"output_root={blocker}/runs", "dry_run=true")
    assert out.returncode == 2, out.stderr
    assert f"error: output_root='{blocker}/runs': cannot make a run directory there" in out.stderr
    assert "Traceback" not in out.stderr
