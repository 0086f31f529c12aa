"""Transformer Engine's import-time environment in a Megatron worker: set before TE is imported, checked after.

TE reads some recipe defaults from the environment when `transformer_engine.common.recipe` is first
imported: `Float8BlockScaling` rounds its scales to powers of two unless
NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1 (the class attributes `fp8_quant_fwd_inp` / `_fwd_weight` /
`_bwd_grad` are built then). skyq's precision fixes the scale grid (`precision.scale_format`), and
the weights pushed to the engine are quantized on it; a trainer whose TE was imported under another
value quantizes its forward on a different grid, silently. So `apply` sets the strategy's trainer env
(`QuantizationStrategy.env_vars`, from the FP8 recipe this worker resolved on its own GPU) before the
first megatron / TE import of the process and refuses if TE was already imported under other values;
`check` asserts, after the model is built, that the imported recipe class holds what was asked.
"""

from __future__ import annotations

import os
import sys

import torch

from skyq.config.enums import Precision
from skyq.config.resolve import resolve_worker
from skyq.config.schema import PrecisionConfig
from skyq.quant.strategies import get_strategy

FP32_SCALES = "NVTE_FP8_BLOCK_SCALING_FP32_SCALES"
FP8_PRECISIONS = (Precision.fp8_blockwise, Precision.mxfp8)


class TeEnvironmentError(RuntimeError):
    """Transformer Engine was (or would be) imported under other settings than the precision's."""


def trainer_env(precision_cfg: PrecisionConfig, device: torch.device) -> dict[str, str]:
    """The strategy's trainer environment for this worker's GPU (empty on the CPU and for precisions
    without a TE recipe)."""
    if device.type != "cuda" or Precision(precision_cfg.name) not in FP8_PRECISIONS:
        return {}
    return env_for_capability(precision_cfg, torch.cuda.get_device_capability(device))


def env_for_capability(precision_cfg: PrecisionConfig, capability: tuple[int, int]) -> dict[str, str]:
    """The trainer environment for an FP8 precision on a GPU of `capability`. Refuses a recipe this
    GPU cannot run natively: `precision.emulate` is exact emulation in skyq's own (torch) trainer and
    engine, but Transformer Engine has no emulation, so a Megatron worker would fail inside TE's
    first GEMM (MXFP8BlockScaling needs SM100+) instead of here."""
    resolution = resolve_worker(precision_cfg, capability)
    if resolution.emulated:
        raise TeEnvironmentError(
            f"precision={Precision(precision_cfg.name).value} resolves to the {resolution.fp8_recipe.value} recipe, "
            f"which compute capability {capability[0]}.{capability[1]} lacks; precision.emulate=true runs it "
            "as exact emulation in skyq's own trainer, but trainer=megatron computes through Transformer "
            "Engine, which has no emulation. Fix: precision=fp8_blockwise on this GPU, or trainer=torch "
            "with precision.emulate=true"
        )
    return dict(get_strategy(precision_cfg).env_vars(resolution.fp8_recipe)["trainer"])


def apply(precision_cfg: PrecisionConfig, device: torch.device) -> dict[str, str]:
    """Set this worker's TE environment now (before megatron / TE are imported); returns it."""
    env = trainer_env(precision_cfg, device)
    imported = "transformer_engine" in sys.modules
    for name, value in env.items():
        if imported and os.environ.get(name) != value:
            raise TeEnvironmentError(
                f"{name}={value} is what precision {Precision(precision_cfg.name).value} (scale_format="
                f"{getattr(precision_cfg.scale_format, 'value', precision_cfg.scale_format)}) needs, but Transformer Engine was imported in this "
                f"process under {name}={os.environ.get(name)!r} and read it then. Fix: set it in "
                "trainer.env (it reaches the worker before any import), or import nothing from TE before "
                "the trainer is built"
            )
        os.environ[name] = value
    return env


def check(env: dict[str, str]) -> None:
    """After TE is imported: its Float8BlockScaling defaults quantize on the grid `env` asked for."""
    if FP32_SCALES not in env:
        return
    from transformer_engine.common.recipe import Float8BlockScaling

    pow2 = env[FP32_SCALES] != "1"
    recipe = Float8BlockScaling()
    got = {
        q: getattr(recipe, q).power_2_scale
        for q in ("fp8_quant_fwd_inp", "fp8_quant_fwd_weight", "fp8_quant_bwd_grad")
    }
    wrong = {q: v for q, v in got.items() if v != pow2}
    if wrong:
        raise TeEnvironmentError(
            f"Transformer Engine's Float8BlockScaling has power_2_scale={wrong} but {FP32_SCALES}="
            f"{env[FP32_SCALES]} asks for {'power-of-two' if pow2 else 'fp32'} scales: TE read another value "
            "at import. The trainer would quantize on a different grid than the weights the engine gets"
        )
