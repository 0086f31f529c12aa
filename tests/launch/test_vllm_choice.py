"""Choosing rollout=vllm, checked without vLLM: what a CPU engine cannot serve is refused before anything
starts, and a run from an environment without vLLM either re-runs in the vLLM one or says how to make it."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

from skyq.config.enums import Precision
from skyq.config.store import compose, to_object
from skyq.rollout.vllm.worker import check_engine_config, model_source


def _cfg(*overrides: str):
    return to_object(compose(["recipe=tiny_moe_bf16_cpu_vllm", *overrides]))


def test_the_cpu_vllm_recipe_passes_and_what_vllm_cpu_cannot_serve_is_refused():
    cfg = _cfg()
    check_engine_config(model=cfg.model, precision=cfg.precision, rollout=cfg.rollout, device="cpu")
    bad = _cfg("model.head_dim=16")
    with pytest.raises(ValueError, match=r"model.head_dim=16: vLLM's CPU attention serves head sizes"):
        check_engine_config(model=bad.model, precision=bad.precision, rollout=bad.rollout, device="cpu")
    tp = _cfg("rollout.tp_size=2")
    with pytest.raises(ValueError, match="rollout.tp_size=2: a vLLM engine on the CPU is one process"):
        check_engine_config(model=tp.model, precision=tp.precision, rollout=tp.rollout, device="cpu")
    # On a GPU none of the CPU limits apply.
    check_engine_config(model=bad.model, precision=bad.precision, rollout=tp.rollout, device="cuda")


def test_the_engine_boots_from_the_rollout_checkpoint_else_bf16_weights_else_dummy_in_the_format():
    assert model_source(precision=Precision.bf16, rollout_checkpoint=None, checkpoint_path="hf") == (
        "hf",
        False,
    )
    assert model_source(precision=Precision.fp8_blockwise, rollout_checkpoint=None, checkpoint_path="hf") == (
        "hf",
        True,
    )
    assert model_source(precision=Precision.int4_qat, rollout_checkpoint="w4a16", checkpoint_path="hf") == (
        "w4a16",
        False,
    )


def test_a_run_without_vllm_anywhere_is_one_error_line(tmp_path):
    """The main environment has no vLLM; with SKYQ_VLLM_PYTHON pointing nowhere the run stops before Ray."""
    spec = importlib.util.find_spec("vllm")  # tests/vllm is a namespace package `vllm` on pytest's path
    if spec is not None and spec.origin is not None:
        pytest.skip("this interpreter has vLLM: the run would start")
    env = {**os.environ, "SKYQ_VLLM_PYTHON": str(tmp_path / "no-python")}
    proc = subprocess.run(
        [sys.executable, "-m", "skyq.train", "recipe=tiny_moe_bf16_cpu_vllm", f"output_root={tmp_path}"],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: rollout=vllm needs vLLM"), proc.stderr
    assert "make setup-vllm" in lines[0]
    assert not list(tmp_path.glob("*/*"))  # no run directory left behind


@pytest.mark.parametrize(
    ("overrides", "transport", "device", "sync_device"),
    [
        (["rollout=vllm", "topology=1gpu"], "broadcast", "cuda", "cpu"),  # never in the driver's process
        (["rollout=vllm", "topology=2gpu"], "broadcast", "cuda", "cpu"),  # frames through host memory
        (["rollout=embedded", "topology=2gpu"], "broadcast", "cuda", "cuda"),  # NCCL between the GPUs
        (["rollout=embedded", "topology=1gpu"], "in_process", "cuda", "cuda"),
        (["rollout=vllm", "topology=cpu"], "broadcast", "cpu", "cpu"),
    ],
)
def test_the_run_places_each_backend_pair_where_it_can_work(overrides, transport, device, sync_device):
    from skyq.launch.loop import run_placement

    cfg = to_object(compose(["precision=bf16", "model=small_moe", *overrides]))
    placed = run_placement(cfg.topology, cfg.trainer, cfg.rollout)
    assert (placed.transport.value, placed.device, placed.sync_device) == (transport, device, sync_device)


def test_in_process_transport_is_refused_for_vllm():
    from skyq.launch.loop import run_placement

    cfg = to_object(
        compose(
            ["precision=bf16", "rollout=vllm", "topology=1gpu", "rollout.weight_sync.transport=in_process"]
        )
    )
    with pytest.raises(
        ValueError, match="rollout.weight_sync.transport=in_process: rollout=vllm runs each engine"
    ):
        run_placement(cfg.topology, cfg.trainer, cfg.rollout)
