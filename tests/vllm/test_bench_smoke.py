"""benchmarks/vllm_rollout.py on the CPU: its `--smoke` run completes with every section measured for
bf16 (a real vLLM engine synced by skyq's sender), its Hydra-less config path builds the same configs
as the composition, and a precision vLLM cannot serve on the CPU is skipped by name, not crashed on."""

from __future__ import annotations

import fcntl
import importlib.util
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from skyq.config.store import compose, to_object

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "vllm_rollout.py"


def _bench():
    spec = importlib.util.spec_from_file_location("vllm_rollout_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # imports no vLLM (engine_args is vLLM-free)
    return module


@pytest.mark.parametrize("precision", ["bf16", "fp8_blockwise", "int4_qat", "mxfp8"])
def test_yaml_fallback_builds_the_composed_config(precision):
    overrides = ["model.head_dim=32", "model.init_sft_steps=7"]
    composed = to_object(compose(["model=small_moe", f"precision={precision}", *overrides]))
    from_yaml = _bench().config_from_yaml("small_moe", precision, overrides)
    assert from_yaml.model == composed.model
    assert from_yaml.precision == composed.precision


def test_yaml_fallback_refuses_what_it_cannot_apply():
    bench = _bench()
    with pytest.raises(ValueError, match="trainer.micro_batch_size"):
        bench.config_from_yaml("tiny_moe", "bf16", ["trainer.micro_batch_size=4"])
    with pytest.raises(ValueError, match="not a field of ModelConfig"):
        bench.config_from_yaml("tiny_moe", "bf16", ["model.hidden=4"])


def test_cpu_skips_vllm_by_name_for_what_it_cannot_serve():
    bench = _bench()
    cfgs = {p: bench.build_config("tiny_moe", p, []) for p in ("bf16", "int4_qat", "mxfp8")}
    env, refused = bench.engine_environment(cfgs, "cpu")
    assert sorted(refused) == ["int4_qat", "mxfp8"]  # bf16 always runs; these on no CPU
    assert all("cannot run on the CPU" in why for why in refused.values())
    assert env == {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


@pytest.mark.slow
def test_smoke_run_measures_every_section_for_bf16(tmp_path):
    cmd = [sys.executable, str(SCRIPT), "--device", "cpu", "--precisions", "bf16", "--smoke",
           "model.init_sft_steps=0", f"checkpoint.cache_dir={tmp_path}"]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    out = done.stdout
    assert done.returncode == 0, done.stderr[-3000:]
    assert "FAILED" not in out, out
    rows = {}
    for section in ("1. sync", "2. vLLM decode", "3. mismatch", "4. embedded"):
        assert section in out, out
        rows[section] = out.split(section, 1)[1].split("\n\n", 1)[0].splitlines()[2:]
    sync = rows["1. sync"][0].split()
    assert sync[0] == "bf16" and float(sync[1]) > 0 and sync[-1] == "1.00"
    for section in ("2. vLLM decode", "4. embedded"):
        assert [r.split()[0] for r in rows[section]] == ["4"]
        assert all(float(r.split()[1]) > 0 for r in rows[section])
    mismatch = rows["3. mismatch"][0].split()
    # bf16 weights on both sides: only the trainer's fp32 compute against vLLM's bf16 kernels differs
    assert mismatch[0] == "bf16" and 0 <= float(mismatch[1]) < 0.05 and int(mismatch[3]) > 0
    assert re.search(r"^command: .*--smoke", out, re.M) and "machine: " in out and "versions: " in out


def _results_file(path: Path, label: str, decode: dict[int, float], mismatch: float) -> Path:
    record = {
        "labels": [label],
        "results": {
            "sync": {},
            "decode": {label: decode},
            "mismatch": {label: {"mean": mismatch, "max": 0.1, "tokens": 512}},
            "embedded": {},
            "boot_s": {label: 1.0},
        },  # fmt: skip
        "args": {
            "repeats": 1,
            "decode_repeats": 1,
            "batches": [1, 64],
            "prompt_len": 16,
            "new_tokens": 8,
            "cuda_graphs": True,
        },  # fmt: skip
        "where": "tiny_moe, test",
    }
    path.write_text(json.dumps(record), encoding="utf-8")
    return path


def test_combine_puts_separate_processes_side_by_side_with_bf16_as_the_baseline(tmp_path, capsys):
    """Variants measured in separate processes (`--json`) are compared in one table (`--combine`),
    bf16 first whatever the order of the files; JSON's string batch keys read back as the batches."""
    files = [
        _results_file(tmp_path / "fp8.json", "fp8_w8a16", {1: 150.0, 64: 1200.0}, 0.003),
        _results_file(tmp_path / "bf16.json", "bf16", {1: 100.0, 64: 1000.0}, 0.002),
    ]
    assert _bench().main(["--combine", *map(str, files)]) == 0
    out = capsys.readouterr().out
    assert re.search(r"\n\s+1\s+100\s+150\s+1\.50 met\n", out), out
    assert re.search(r"\n\s+64\s+1000\s+1200\s+1\.20 MISS\n", out), out
    assert re.search(r"fp8_w8a16\s+0\.00300\s+0\.1000\s+512\s+1\.50 met", out), out


def test_a_turn_waits_for_the_others_boots_then_measures_under_the_lock(tmp_path):
    """`--turn DIR:N`: a booted process waits until N have booted or ended (never past its wait), then
    holds the lock; `finished` marks it ended and releases the lock."""
    bench = _bench()
    turn = bench.Turn(f"{tmp_path}:2", wait_s=0.5)
    start = time.monotonic()
    turn.booted()  # the other process never arrives: it waits its 0.5 s, then goes on
    assert time.monotonic() - start >= 0.5
    other = open(tmp_path / "lock", "a+")  # noqa: SIM115
    with pytest.raises(BlockingIOError):  # the lock is held while measuring
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
    turn.finished()
    fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released
    other.close()
    (tmp_path / "4242.done").touch()  # another process that ended (booted or not)
    late = bench.Turn(f"{tmp_path}:2", wait_s=30)
    start = time.monotonic()
    late.booted()  # its own ready file plus the ended one: no wait
    assert time.monotonic() - start < 5
    late.finished()
