"""Kimi-K2.6's text recipe end to end at tiny scale on the CPU, as a user runs it:
`recipe=kimi_k26_int4_qat_256gpu_text` with the tiny DeepSeek-V3 and the CPU overrides (what
recipes/tiny_deepseek_int4_qat_cpu_kimi_text.yaml sets), the trainer starting from the BF16 cast of a
converted W4A16 release and the engine booting from that release (the seed's two-checkpoint layout),
real Ray actors, every sync accounted."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from skyq.config.store import compose, to_object
from skyq.launch.actors import EngineWorker
from skyq.quant.plan import build_plan
from skyq.sync.plan_wire import wire_digest
from skyq.tools import convert_hf_to_int4, convert_moe_int4_to_bf16
from skyq.trainer.native.tiny_checkpoint import ensure_tiny_checkpoint

ROOT = Path(__file__).resolve().parents[2]
RECIPE = "kimi_k26_int4_qat_256gpu_text"
TINY_CPU = [
    "model=tiny_deepseek", "topology=cpu", "trainer=torch", "rollout=embedded", "task=arith",
    "checkpoint.rollout_checkpoint=null", "checkpoint.ref_load=null",
    "topology.parallel.first_stage_layers=null", "topology.parallel.last_stage_layers=null",
    "rollout.gpus_per_engine=1", "rollout.dp_size=1", "rollout.ep_size=1",
    "trainer.optimizer.cpu_offload=false", "trainer.optimizer.overlap_cpu_offload=false",
    "trainer.optimizer.precision_aware=false", "trainer.recompute.granularity=none",
    "trainer.moe_token_dispatcher=alltoall", "trainer.deepep_max_dispatch_tokens=0",
    "task.max_prompt_length=8", "task.max_response_length=4", "task.eval.dataset=null", "task.eval.interval=0",
]  # fmt: skip
"""The overrides that put the 256-GPU recipe on the CPU with the embedded pair (arith: dapo_math reads
the user's data files)."""
WARM_UP = ["model.init_sft_steps=10"]
"""A short supervised warm-up of the tiny checkpoint (the run only needs a policy, not a good one)."""


def test_the_tiny_recipe_file_is_the_kimi_recipe_with_these_overrides():
    """recipes/tiny_deepseek_int4_qat_cpu_kimi_text.yaml composes to the 256-GPU recipe with TINY_CPU
    and its own run settings: Kimi's precision (W4A16 g32, kimi grid, routed experts) kept."""
    tiny = to_object(compose(["recipe=tiny_deepseek_int4_qat_cpu_kimi_text"]))
    run_settings = [
        "checkpoint.hf_checkpoint=null", "algorithm.num_steps=40", "algorithm.group_size=8",
        "algorithm.global_batch_size=64", "algorithm.lr=3e-3", "trainer.micro_batch_size=16",
        "task.arith_op=copy", "model.init_sft_steps=10",
    ]  # fmt: skip
    assert tiny == to_object(compose([f"recipe={RECIPE}", *TINY_CPU, *run_settings]))
    precision = tiny.precision
    assert (precision.int4_group_size, precision.int4_grid.value, precision.qat_scope.value) == (
        32,
        "kimi",
        "routed_experts",
    )


@pytest.mark.slow  # two Ray actors and a warm-up: ~60 s of an idle 2-core CPU, minutes on a loaded one
def test_kimi_text_recipe_runs_on_the_cpu_from_the_bf16_cast_of_a_w4a16_release(tmp_path):
    cfg = to_object(compose([f"recipe={RECIPE}", *TINY_CPU, *WARM_UP]))
    tiny = ensure_tiny_checkpoint(cfg.model, cfg.task, cache_dir=ROOT / ".skyq_cache")
    release, cast = tmp_path / "release", tmp_path / "bf16"
    assert (
        convert_hf_to_int4.main(["--model-dir", str(tiny), "--save-dir", str(release), "--group-size", "32"])
        == 0
    )
    assert convert_moe_int4_to_bf16.main(["--model-dir", str(release), "--output-dir", str(cast)]) == 0
    # the engine boots from the W4A16 release itself (version 0), holding exactly its tensors
    worker = EngineWorker(
        model_cfg=cfg.model, precision_cfg=cfg.precision, device="cpu", seed=0, eos_token_id=0,
        rollout_checkpoint=str(release),
    )  # fmt: skip
    shipped = {}
    for shard in sorted(release.glob("*.safetensors")):
        shipped.update(load_file(shard))
    assert worker.weight_version() == 0 and worker.wire_digest() == wire_digest(shipped)
    worker.close()
    runs = tmp_path / "runs"
    with_release = [a for a in TINY_CPU if not a.startswith("checkpoint.rollout_checkpoint=")]
    args = [
        f"recipe={RECIPE}", *with_release, f"checkpoint.rollout_checkpoint={release}", *WARM_UP,
        f"checkpoint.hf_checkpoint={cast}", "algorithm.num_steps=2",
        "algorithm.group_size=4", "algorithm.global_batch_size=16", "trainer.micro_batch_size=16",
        f"output_root={runs}", f"checkpoint.cache_dir={ROOT / '.skyq_cache'}", "logger.progress_bar=false",
        "logger.plot=false", "checkpoint.save_interval=0",
    ]  # fmt: skip
    out = subprocess.run(
        [sys.executable, "-m", "skyq.train", *args], capture_output=True, text=True, cwd=tmp_path, timeout=900
    )
    assert out.returncode == 0, out.stderr[-3000:]
    (run_dir,) = [p for p in runs.iterdir() if p.is_dir()]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1] and [r["weight_version"] for r in rows] == [1, 2]
    wire = [w for p in build_plan(cfg.model, cfg.precision) for w in p.wire]
    for row in rows:
        assert 0.0 <= row["reward"] <= 1.0 and math.isfinite(row["loss"])
        # every sync accounted: the plan's wire tensors and bytes, router bias and INT4 words included
        assert row["sync/version"] == row["weight_version"]
        assert (row["sync/num_tensors"], row["sync/bytes"]) == (len(wire), sum(w.nbytes for w in wire))
        assert row["mismatch/mean_abs_dlogp"] < 0.03
    saved = json.loads((run_dir / "skyq_config.json").read_text())["config"]
    assert saved["model"]["family"] == "deepseek_v3" and saved["precision"]["name"] == "int4_qat"
    assert saved["checkpoint"]["hf_checkpoint"] == str(cast)
    assert saved["checkpoint"]["rollout_checkpoint"] == str(release)
