"""benchmarks/vllm_rollout.py on the CPU: its `--smoke` run completes with every section measured for
bf16 (a real vLLM engine synced by skyq's sender), its Hydra-less config path builds the same configs
as the composition, and a precision vLLM cannot serve on the CPU is skipped by name, not crashed on."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
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
