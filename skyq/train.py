"""`python -m skyq.train`: compose -> validate -> (dry run | build and run).

python -m skyq.train                                   # the embedded default: tiny MoE, CPU
python -m skyq.train precision=mxfp8 model=qwen3_30b topology=8gpu dry_run=true
python -m skyq.train --help
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from skyq import preflight
from skyq.config.enums import Device, ModelFamily, RolloutBackend, TrainerBackend
from skyq.config.schema import TrainConfig
from skyq.config.store import register, strict
from skyq.config.validate import ConfigValidationError, validate
from skyq.launch.guards import MismatchError

register()


class HardwareMissingError(RuntimeError):
    """The run needs hardware or a backend this machine does not have."""


EMBEDDED_MAX_PARAMS = 2e9
"""Largest model the embedded native trainer + engine pair is meant to hold on one device."""


def check_hardware(cfg: TrainConfig) -> None:
    """Refuse what this machine or this build cannot run, before anything starts."""
    if cfg.trainer.backend is TrainerBackend.torch and cfg.model.family is not ModelFamily.qwen3_moe:
        raise HardwareMissingError(
            f"model={cfg.model.name} (model.family={cfg.model.family.value}) with trainer=torch: the native "
            "trainer builds qwen3_moe models only. Use trainer=megatron on a GPU cluster, or add dry_run=true "
            "to print the plan."
        )
    if cfg.topology.device is Device.cpu:
        from skyq.quant.plan import build_plan

        params = build_plan(cfg.model, cfg.precision).bf16_bytes / 2
        if params > EMBEDDED_MAX_PARAMS:
            raise HardwareMissingError(
                f"model={cfg.model.name} has {params / 1e9:.1f}B parameters; topology=cpu runs the embedded "
                f"trainer and engine on this machine's CPU (meant for models up to {EMBEDDED_MAX_PARAMS / 1e9:.0f}B, "
                "e.g. model=tiny_moe). Pick a GPU topology, or add dry_run=true to print the plan."
            )
        return
    import torch

    have = torch.cuda.device_count()  # counts devices without creating a CUDA context
    need = cfg.topology.gpus_per_node
    if have < need:
        raise HardwareMissingError(
            f"topology={cfg.topology.name} needs {need} CUDA GPUs per node x {cfg.topology.num_nodes} node(s) "
            f"(trainer_gpus={cfg.topology.trainer_gpus}, rollout_gpus={cfg.topology.rollout_gpus}, "
            f"{cfg.topology.placement.value}), but this machine has {have}. "
            "Add dry_run=true to print the resolved plan without GPUs, or run topology=cpu."
        )
    if cfg.trainer.backend is TrainerBackend.megatron or cfg.rollout.backend is RolloutBackend.vllm:
        raise HardwareMissingError(
            f"trainer={cfg.trainer.backend.value} rollout={cfg.rollout.backend.value}: the Megatron-core/TE "
            "trainer and vLLM rollout backends are not in this build of skyq yet; run trainer=torch "
            "rollout=embedded (topology=cpu, 1gpu or 2gpu), or add dry_run=true to print the plan."
        )


def run(cfg: DictConfig, run_dir: Path) -> None:
    """Validate, then dry-run or run. Raises on any configuration problem."""
    cfg = strict(cfg)
    obj: TrainConfig = OmegaConf.to_object(cfg)  # type: ignore[assignment]
    report = validate(obj)
    preflight.check(model=obj.model, precision=obj.precision, checkpoint=obj.checkpoint)
    if obj.dry_run:
        from skyq.dryrun import render_plan

        print(render_plan(obj, report))
        return
    check_hardware(obj)
    from skyq.launch.embedded import run_embedded

    result = run_embedded(
        model=obj.model,
        precision=obj.precision,
        algorithm=obj.algorithm,
        task=obj.task,
        rollout=obj.rollout,
        trainer=obj.trainer,
        topology=obj.topology,
        logger=obj.logger,
        checkpoint=obj.checkpoint,
        seed=obj.seed,
        config_container=OmegaConf.to_container(cfg, resolve=True, enum_to_str=True),  # type: ignore[arg-type]
        run_dir=Path(obj.resume) if obj.resume else run_dir,
        resume=obj.resume is not None,
    )
    print(
        f"run {result.run_dir}: steps {result.start_step}..{result.num_steps}, weight version "
        f"{result.weight_version}, mean reward first 10 steps {result.reward_first:.3f} -> last 10 "
        f"{result.reward_last:.3f}, {result.wall_s:.0f} s"
    )


def resumed_config(cfg: DictConfig, overrides: list[str]) -> DictConfig:
    """`resume=<run dir>`: the run's own saved config, plus this command line's explicit key overrides.

    Group overrides (`precision=bf16`) would make it another run and are refused. Secrets were redacted
    when the config was saved; each comes back from this command line or the environment.
    """
    from skyq.config.store import GROUPS
    from skyq.launch.rundir import load_saved_config

    explicit = [o.lstrip("+") for o in overrides if not o.lstrip("+~").startswith("resume=")]
    groups = [o for o in explicit if o.split("=", 1)[0] in (*GROUPS, "recipe")]
    if groups:
        raise ValueError(
            f"resume={cfg.resume} continues that run with its own config; group overrides {groups} would make "
            "it a different run. Start a new run instead, or override single keys (e.g. algorithm.num_steps=200)."
        )
    saved = OmegaConf.create(load_saved_config(cfg.resume))
    merged = OmegaConf.merge(saved, OmegaConf.from_dotlist(explicit))
    for side in ("trainer", "rollout"):
        env = merged[side].env
        for key, value in list(env.items()):
            if isinstance(value, str) and value.startswith("<redacted"):
                restored = cfg[side].env[key] if key in cfg[side].env else os.environ.get(key)
                if restored is None:
                    raise ValueError(
                        f"{side}.env.{key} was redacted when run {cfg.resume} saved its config; pass "
                        f"{side}.env.{key}=... again or export {key} to resume"
                    )
                env[key] = restored
    merged.resume = str(Path(cfg.resume).expanduser().resolve())
    return merged


@hydra.main(config_path="../conf", config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> None:
    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    try:
        if cfg.resume:
            cfg = resumed_config(cfg, list(hydra_cfg.overrides.task))
        run(cfg, run_dir)
    except (ConfigValidationError, HardwareMissingError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    except MismatchError as exc:  # the run stopped itself; its run dir holds the evidence
        print(f"error: run {run_dir} stopped: {exc}", file=sys.stderr)
        sys.exit(1)
    finally:
        if run_dir.is_dir() and not any(run_dir.iterdir()):
            run_dir.rmdir()  # a dry run or a refused config leaves no empty run directory behind


if __name__ == "__main__":
    main()
