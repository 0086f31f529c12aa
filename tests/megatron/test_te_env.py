"""skyq.trainer.megatron.te_env: Transformer Engine's import-time env is set before TE loads and checked after.

Transformer Engine does not install on this CPU machine, so these tests stand a minimal module in for
`transformer_engine` (a `Float8BlockScaling` whose scale-grid flags are given); the real TE is checked
by tests/gpu/test_megatron_te.py on the H200.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

from skyq.config.enums import Precision
from skyq.config.schema import PrecisionConfig
from skyq.trainer.megatron import te_env


def _fake_te(monkeypatch, power_2_scale: bool) -> None:
    qparams = types.SimpleNamespace(power_2_scale=power_2_scale)

    class Float8BlockScaling:
        fp8_quant_fwd_inp = fp8_quant_fwd_weight = fp8_quant_bwd_grad = qparams

    recipe = types.ModuleType("transformer_engine.common.recipe")
    recipe.Float8BlockScaling = Float8BlockScaling
    monkeypatch.setitem(sys.modules, "transformer_engine", types.ModuleType("transformer_engine"))
    monkeypatch.setitem(
        sys.modules, "transformer_engine.common", types.ModuleType("transformer_engine.common")
    )
    monkeypatch.setitem(sys.modules, "transformer_engine.common.recipe", recipe)


def test_nothing_to_set_on_the_cpu_or_without_an_fp8_recipe():
    assert te_env.trainer_env(PrecisionConfig(name="fp8_blockwise"), torch.device("cpu")) == {}
    assert te_env.trainer_env(PrecisionConfig(name="bf16"), torch.device("cuda")) == {}


def test_apply_sets_the_env_and_refuses_a_te_imported_under_another_value(monkeypatch):
    monkeypatch.setattr(te_env, "trainer_env", lambda *a: {te_env.FP32_SCALES: "1"})
    monkeypatch.delenv(te_env.FP32_SCALES, raising=False)
    monkeypatch.delitem(sys.modules, "transformer_engine", raising=False)
    assert te_env.apply(PrecisionConfig(name="fp8_blockwise"), torch.device("cuda")) == {
        te_env.FP32_SCALES: "1"
    }
    import os

    assert os.environ[te_env.FP32_SCALES] == "1"
    monkeypatch.setenv(te_env.FP32_SCALES, "0")
    _fake_te(monkeypatch, power_2_scale=True)
    with pytest.raises(te_env.TeEnvironmentError, match="NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1 is what"):
        te_env.apply(PrecisionConfig(name="fp8_blockwise"), torch.device("cuda"))


@pytest.mark.parametrize(
    "value, pow2, ok", [("1", False, True), ("0", True, True), ("1", True, False), ("0", False, False)]
)
def test_check_compares_the_imported_recipe_with_the_env(monkeypatch, value, pow2, ok):
    _fake_te(monkeypatch, power_2_scale=pow2)
    if ok:
        te_env.check({te_env.FP32_SCALES: value})
    else:
        with pytest.raises(te_env.TeEnvironmentError, match="different grid"):
            te_env.check({te_env.FP32_SCALES: value})
    te_env.check({})  # bf16 / int4: nothing asked, nothing checked


def test_a_recipe_te_cannot_run_on_this_gpu_is_refused_not_emulated():
    """MXFP8 on a Hopper GPU: skyq's trainers emulate it when asked, TE cannot, so the Megatron
    worker refuses before TE is imported, naming the fix."""
    mxfp8 = PrecisionConfig(name=Precision.mxfp8, emulate=True)
    with pytest.raises(te_env.TeEnvironmentError, match=r"mxfp8 recipe.*9\.0.*Fix: precision=fp8_blockwise"):
        te_env.env_for_capability(mxfp8, (9, 0))
    assert te_env.env_for_capability(mxfp8, (10, 0)) == te_env.env_for_capability(
        PrecisionConfig(name=Precision.mxfp8), (10, 0)
    )
    blockwise = te_env.env_for_capability(PrecisionConfig(name=Precision.fp8_blockwise), (9, 0))
    assert set(blockwise) == {te_env.FP32_SCALES}
