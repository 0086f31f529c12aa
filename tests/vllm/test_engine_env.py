"""The FP8 scale format reaches the vLLM engine's environment: `precision.scale_format=ue8m0` (the
trainer fake-quantizes weights and activations with power-of-two scales) sets
VLLM_USE_DEEP_GEMM_E8M0=1 in the engine process before vLLM is imported, so vLLM's block-FP8 path
quantizes activations with the same power-of-two rule; a rollout.env entry contradicting it is refused
with one error naming the key, at validation and again on the engine worker."""

from __future__ import annotations

import pytest

from skyq.config.enums import Fp8Recipe, Precision, ScaleFormat
from skyq.config.schema import ModelConfig, PrecisionConfig, RolloutConfig
from skyq.config.store import compose, to_object
from skyq.config.validate import ConfigValidationError, validate
from skyq.quant.fake_quant import activation_fake_quant
from skyq.rollout.vllm import worker
from skyq.rollout.vllm.engine_args import MULTIPROCESSING, engine_env

KEY = "VLLM_USE_DEEP_GEMM_E8M0"


def _fp8(scale_format: ScaleFormat) -> PrecisionConfig:
    return PrecisionConfig(name=Precision.fp8_blockwise, scale_format=scale_format)


def test_scale_format_sets_deep_gemm_e8m0_on_hopper_and_blackwell():
    assert activation_fake_quant(_fp8(ScaleFormat.ue8m0)).pow2_scale  # the trainer's side of the grid
    for recipe in (Fp8Recipe.blockwise, Fp8Recipe.mxfp8):
        assert engine_env(_fp8(ScaleFormat.ue8m0), recipe, RolloutConfig())[KEY] == "1"
    assert engine_env(_fp8(ScaleFormat.fp32), Fp8Recipe.blockwise, RolloutConfig())[KEY] == "0"
    # the same value given again is no contradiction
    same = RolloutConfig(env={KEY: "1"})
    assert engine_env(_fp8(ScaleFormat.ue8m0), Fp8Recipe.blockwise, same)[KEY] == "1"


def test_contradicting_rollout_env_is_refused_on_the_worker():
    for scale_format, value in ((ScaleFormat.fp32, "1"), (ScaleFormat.ue8m0, "0")):
        with pytest.raises(
            ValueError, match=rf"^rollout.env.{KEY}={value} contradicts .*precision.scale_format="
        ):
            engine_env(_fp8(scale_format), Fp8Recipe.blockwise, RolloutConfig(env={KEY: value}))


def _validated(*overrides: str):
    return validate(to_object(compose(["recipe=small_moe_fp8_blockwise_1gpu", "rollout=vllm", *overrides])))


def test_validation_refuses_the_contradiction_with_one_line_naming_the_key():
    _validated("precision=fp8_blockwise", "precision.scale_format=ue8m0", f"+rollout.env.{KEY}=1")
    with pytest.raises(ConfigValidationError) as failure:
        _validated("precision=fp8_blockwise", f"+rollout.env.{KEY}=1")
    lines = [line for line in str(failure.value).splitlines() if KEY in line]
    assert (
        len(lines) == 1 and f"rollout.env.{KEY}=1" in lines[0] and "precision.scale_format=fp32" in lines[0]
    )
    _validated("precision=bf16", f"+rollout.env.{KEY}=1")  # bf16 sets no such variable


def test_the_engine_worker_applies_its_own_resolution_before_importing_vllm(monkeypatch):
    """The worker resolves the recipe from its GPU (a Hopper here) and hands the engine environment to
    `apply_env` before anything imports vLLM; the boot itself is stopped right after."""
    import torch

    applied: list[dict[str, str]] = []
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(worker, "apply_env", applied.append)

    class Stop(Exception):
        pass

    def stop(**_):
        raise Stop

    monkeypatch.setattr(worker, "engine_kwargs", stop)
    args = dict(model_cfg=ModelConfig(), checkpoint_path="unused", rollout_checkpoint=None, device="cuda",
                seed=0, eos_token_id=2)  # fmt: skip
    with pytest.raises(Stop):
        worker.VllmEngineWorker(precision_cfg=_fp8(ScaleFormat.ue8m0), rollout_cfg=RolloutConfig(), **args)
    assert applied[-1][KEY] == "1" and applied[-1]["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    with pytest.raises(ValueError, match=rf"rollout.env.{KEY}=1 contradicts"):
        worker.VllmEngineWorker(
            precision_cfg=_fp8(ScaleFormat.fp32), rollout_cfg=RolloutConfig(env={KEY: "1"}), **args
        )


def test_engine_core_process_key_sets_vllm_multiprocessing_and_owns_it():
    bf16 = PrecisionConfig(name=Precision.bf16)
    assert engine_env(bf16, Fp8Recipe.auto, RolloutConfig())[MULTIPROCESSING] == "0"
    assert engine_env(bf16, Fp8Recipe.auto, RolloutConfig(engine_core_process=True))[MULTIPROCESSING] == "1"
    with pytest.raises(
        ValueError, match=rf"^rollout.env.{MULTIPROCESSING}=1 contradicts rollout.engine_core_process"
    ):
        engine_env(bf16, Fp8Recipe.auto, RolloutConfig(env={MULTIPROCESSING: "1"}))


def test_a_gpu_engine_boots_without_the_jit_compiles_rollout_env_can_bring_back():
    """The boot-time JIT defaults reach GPU engines only (a CPU engine resolves `auto`), under any
    precision, and a rollout.env entry wins over them."""
    from skyq.rollout.vllm.engine_args import GPU_BOOT_DEFAULTS

    bf16 = PrecisionConfig(name=Precision.bf16)
    for precision in (bf16, _fp8(ScaleFormat.fp32)):
        env = engine_env(precision, Fp8Recipe.blockwise, RolloutConfig())
        assert GPU_BOOT_DEFAULTS.items() <= env.items()
    assert not GPU_BOOT_DEFAULTS.keys() & engine_env(bf16, Fp8Recipe.auto, RolloutConfig()).keys()
    mine = RolloutConfig(env={"VLLM_DEEP_GEMM_WARMUP": "full"})
    assert engine_env(bf16, Fp8Recipe.blockwise, mine)["VLLM_DEEP_GEMM_WARMUP"] == "full"
