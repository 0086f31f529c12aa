"""`run_rl`: skyq's one RL loop, over a trainer worker and a group of rollout-engine workers.

It knows no backend: the (trainer.backend, rollout.backend) pair names the worker classes through
`skyq.launch.registry`, and the loop drives them through `WorkerPair` (Ray actors, or both in this
process when they share one GPU: see `skyq.launch.placement`) and the worker protocols of
`skyq.launch.protocols`. A new backend is a package and a registry line; this file does not change.

Per step s: sync the trainer's weights to every engine as version s+1 (the version advances only
when each engine has verified and committed it) -> sample
`global_batch_size / group_size` prompts x `group_size` responses -> rewards -> group advantages ->
one trainer update (which also measures the train/rollout mismatch) -> metrics; a checkpoint every
`checkpoint.save_interval` steps and at the end. A resume continues at the checkpoint's step and
weight version with the same data order, after verifying that the engine holds the trainer's weights.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from skyq.config.enums import RolloutBackend, TrainerBackend, WeightSyncMode
from skyq.config.schema import (
    AlgorithmConfig,
    CheckpointConfig,
    EvalConfig,
    LoggerConfig,
    ModelConfig,
    PrecisionConfig,
    RolloutConfig,
    TaskConfig,
    TopologyConfig,
    TrainerConfig,
)
from skyq.launch.checkpointing import checkpoint_root, latest_checkpoint
from skyq.launch.deadlines import WorkerTimeout
from skyq.launch.guards import MismatchGuard
from skyq.launch.metrics import MetricsLogger, keep_rows_before, read_metrics
from skyq.launch.pair import PairSpec, WorkerPair
from skyq.launch.placement import describe, describe_plan, run_placement, run_plan
from skyq.launch.plan import PlacementPlan
from skyq.launch.plot import plot_run
from skyq.launch.ray_local import local_ray, startup_line
from skyq.launch.redaction import redact
from skyq.launch.registry import lookup
from skyq.launch.rundir import (
    METRICS_FILE,
    PLOT_FILE,
    RunDirError,
    check_resume_compatible,
    claim_run_dir,
    release_run_dir,
    save_resolved_config,
)
from skyq.rl.batch import Sample, collate
from skyq.rl.tasks import Prompt, Task, build_task, tokenizer_for


@dataclass(frozen=True, slots=True)
class RunResult:
    """What a finished (or resumed and finished) run did."""

    run_dir: Path
    start_step: int
    """First step this invocation ran (0, or the checkpoint's step on resume)."""
    num_steps: int
    weight_version: int
    """Version the engine held at the last step."""
    reward_first: float
    """Mean reward of the run's first 10 steps (over metrics.jsonl, resumed runs included)."""
    reward_last: float
    """Mean reward of the run's last 10 steps."""
    wall_s: float


IMAGE_BACKENDS = (TrainerBackend.torch, RolloutBackend.embedded)
"""The backend pair whose workers take a prompt's images (the native trainer and the embedded engine)."""


def check_supported(
    *,
    rollout: RolloutConfig,
    trainer: TrainerConfig,
    algorithm: AlgorithmConfig,
    task: TaskConfig | None = None,
) -> None:
    """Refuse settings the run loop cannot honour, naming the key and the fix: a backend pair with no
    registered workers (`skyq.launch.registry`), a delta sync, a multimodal task on a pair whose workers
    would not be given its images."""
    lookup(trainer.backend, rollout.backend)
    pair = (TrainerBackend(trainer.backend), RolloutBackend(rollout.backend))
    if task is not None and task.image_key is not None and pair != IMAGE_BACKENDS:
        raise ValueError(
            f"task.image_key={task.image_key}: trainer={pair[0].value} rollout={pair[1].value} is not given a "
            "prompt's images (only trainer=torch rollout=embedded are). Fix: trainer=torch rollout=embedded, "
            "or a text task"
        )
    if WeightSyncMode(rollout.weight_sync.mode) is not WeightSyncMode.full:
        raise ValueError("rollout.weight_sync.mode=delta is not implemented by the run loop; use full")
    if algorithm.global_batch_size % algorithm.group_size:
        raise ValueError(
            f"algorithm.global_batch_size={algorithm.global_batch_size} is not a multiple of "
            f"algorithm.group_size={algorithm.group_size}; each prompt gets group_size responses"
        )


def rollout_seed(seed: int, step: int) -> int:
    """The engine's sampling seed of step `step`: a function of (seed, step) only, so a resume matches."""
    return int.from_bytes(hashlib.sha256(f"skyq-rollout:{seed}:{step}".encode()).digest()[:8], "little") >> 1


def local_cpus(plan: PlacementPlan | None) -> int:
    """Logical CPUs of the run's own local Ray cluster: what the plan's bundles hold (a GPU plan: one
    per GPU), at least the two a CPU plan's trainer and engines share."""
    bundles = plan.bundles if plan is not None else []
    return max(2, math.ceil(sum(b.get("CPU", 0) for b in bundles)))


@contextmanager
def worker_pair(
    spec: PairSpec,
    plan: PlacementPlan | None = None,
    *,
    placement_timeout_s: float = TopologyConfig.placement_timeout_s,
) -> Iterator[WorkerPair]:
    """Build the trainer/engine pair where `spec.placement` puts it (Ray actors: on `plan`'s
    placement group, reserved within `placement_timeout_s`); always shut it down."""
    if spec.placement.in_process:
        from skyq.launch.local_pair import LocalPair

        startup_line("building the trainer and the engine in this process (model build, engine boot)")
        started = time.perf_counter()
        pair: WorkerPair = LocalPair(spec)
        startup_line(f"trainer and engine ready after {time.perf_counter() - started:.1f} s")
        try:
            yield pair
        finally:
            pair.shutdown()
        return
    with local_ray(num_cpus=local_cpus(plan)):
        from skyq.launch.actor_pair import ActorPair

        pair = ActorPair(spec, plan, placement_timeout_s=placement_timeout_s)
        try:
            yield pair
        finally:
            pair.shutdown()


def run_step(
    pair: WorkerPair,
    task: Task,
    step: int,
    *,
    algorithm: AlgorithmConfig,
    task_cfg: TaskConfig,
    rollout: RolloutConfig,
    seed: int,
    verify_sync: bool,
) -> dict[str, Any]:
    """One RL step; returns its metrics row."""
    start = time.perf_counter()
    version = step + 1
    sync = pair.sync(version)
    if verify_sync:
        pair.verify_engine_matches_trainer()
    ev = task_cfg.eval
    scores = (
        evaluate(pair, task, ev, task_cfg, rollout, seed) if ev.interval and step % ev.interval == 0 else {}
    )
    group = algorithm.group_size
    prompts = task.prompts(step, algorithm.global_batch_size // group)
    samples, rewards = _sampled(pair, task, prompts, group, task_cfg.max_response_length,
                                max_image_tokens=task_cfg.max_image_tokens, temperature=rollout.temperature,
                                top_p=rollout.top_p, seed=rollout_seed(seed, step))  # fmt: skip
    batch = collate(
        samples,
        rewards,
        group_size=group,
        normalize_std=algorithm.normalize_adv_std,
        pad_token_id=task.tokenizer.eos_token_id,
    )
    rolled_out = time.perf_counter()
    train = pair.train_step(batch)
    done = time.perf_counter()
    return {
        "step": step,
        "weight_version": version,
        "reward": sum(rewards) / len(rewards),
        "response_length": sum(len(s.response_ids) for s in samples) / len(samples),
        "loss": train["loss"],
        "grad_norm": train["grad_norm"],
        "lr": train["lr"],
        "mismatch/mean_abs_dlogp": train["mismatch_mean_abs"],
        "mismatch/k3_kl": train["mismatch_k3"],
        "mismatch/max_abs_dlogp": train["mismatch_max"],
        **sync,
        **scores,
        "time/step_s": done - start,
        "time/rollout_s": rolled_out - start - sync["sync/total_s"] - scores.get("eval/time_s", 0.0),
        "time/train_s": done - rolled_out,
        **{f"train/{k}": v for k, v in train.items()},
    }


def _sampled(
    pair: WorkerPair,
    task: Task,
    prompts: list[Prompt],
    n: int,
    max_new_tokens: int,
    *,
    max_image_tokens: int,
    **sampling: Any,
) -> tuple[list[Sample], list[float]]:
    """`n` engine samples of each prompt (in prompt order) and each sample's reward. A prompt with images
    goes to the engine as an `ImagePrompt`: its placeholders expanded to its images' tokens (within
    `max_image_tokens` each), the images with it; its samples carry them on to the trainer."""
    inputs = [_model_input(task, p, max_image_tokens) for p in prompts]
    samples = pair.generate(inputs, n=n, max_new_tokens=max_new_tokens, **sampling)
    return samples, [task.reward(prompts[i // n], s.response_ids) for i, s in enumerate(samples)]


def _model_input(task: Task, prompt: Prompt, max_image_tokens: int) -> list[int]:
    """The token ids the engine is given: the prompt's own, or for a prompt with images an `ImagePrompt`."""
    if not prompt.images:
        return prompt.token_ids
    from skyq.rl import image_tokens

    token_id = image_tokens.image_token_id(task.tokenizer)
    return image_tokens.expand(
        prompt.token_ids, prompt.images, token_id=token_id, max_tokens=max_image_tokens
    )


def eval_seed(seed: int) -> int:
    """The engine's sampling seed of every eval of a run (the same draws each time: evals differ only
    by the weights)."""
    return rollout_seed(seed, -1)


def evaluate(
    pair: WorkerPair, task: Task, ev: EvalConfig, task_cfg: TaskConfig, rollout: RolloutConfig, seed: int
) -> dict[str, float]:
    """Score the engine's current weights on the task's eval prompts (`Task.eval_prompts`):
    `task.eval.num_samples` responses each at `task.eval.temperature` (0 = greedy) and rollout.top_p.
    eval/reward is the mean reward of all responses, eval/best_of_n the mean over prompts of the best
    one's, eval/time_s the wall time."""
    start = time.perf_counter()
    prompts = task.eval_prompts()
    n = ev.num_samples
    _, rewards = _sampled(pair, task, prompts, n, task_cfg.max_response_length,
                          max_image_tokens=task_cfg.max_image_tokens, temperature=ev.temperature,
                          top_p=rollout.top_p, seed=eval_seed(seed))  # fmt: skip
    best = [max(rewards[i : i + n]) for i in range(0, len(rewards), n)]
    return {
        "eval/reward": sum(rewards) / len(rewards),
        "eval/best_of_n": sum(best) / len(best),
        "eval/prompts": float(len(prompts)),
        "eval/time_s": time.perf_counter() - start,
    }


def run_rl(
    *,
    model: ModelConfig,
    precision: PrecisionConfig,
    algorithm: AlgorithmConfig,
    task: TaskConfig,
    rollout: RolloutConfig,
    trainer: TrainerConfig,
    topology: TopologyConfig,
    logger: LoggerConfig,
    checkpoint: CheckpointConfig,
    seed: int,
    config_container: dict[str, Any],
    run_dir: str | Path,
    resume: bool = False,
) -> RunResult:
    """Run (or, with `resume=True`, continue) the RL loop in `run_dir`.

    Args:
        config_container: the resolved config as plain data (`OmegaConf.to_container(cfg, resolve=True,
            enum_to_str=True)`); saved to the run dir and to wandb with env secrets redacted, and
            compared with the run's saved config on resume.
        run_dir: a new, empty directory for a fresh run; for a resume, the killed run's directory.
        resume: continue `run_dir` from its newest checkpoint.
    """
    check_supported(rollout=rollout, trainer=trainer, algorithm=algorithm, task=task)
    placement = run_placement(topology, trainer, rollout)
    plan = run_plan(topology, trainer, rollout)
    # The task (its tokenizer and dataset) is checked before the run directory is touched.
    tokenizer = tokenizer_for(
        task, checkpoint_dir=checkpoint.hf_checkpoint, model_vocab_size=model.vocab_size
    )
    task_obj = build_task(task, seed=seed, tokenizer=tokenizer)
    started = time.perf_counter()
    run_dir = Path(run_dir).expanduser().resolve()
    ckpt_root = checkpoint_root(run_dir, checkpoint.save)
    if resume:
        check_resume_compatible(run_dir, config_container)
    elif (run_dir / METRICS_FILE).exists() or ckpt_root.exists():
        raise RunDirError(
            f"{run_dir} already holds a run; pass resume=<run dir> to continue it, or use a new directory"
        )
    run_dir.mkdir(parents=True, exist_ok=True)
    claim_run_dir(run_dir, resume=resume)
    try:
        start_step = 0
        if resume:
            ckpt_dir, state = latest_checkpoint(ckpt_root)
            if state.seed != seed:
                raise RunDirError(f"{ckpt_dir}: saved with seed {state.seed}, resuming with seed {seed}")
            start_step = state.next_step
            keep_rows_before(run_dir / METRICS_FILE, start_step)
        # On resume this records the (compatible) config the run continues with, e.g. more steps.
        save_resolved_config(run_dir, config_container)
        print(describe(placement))
        if plan is not None:
            print(describe_plan(plan))
        print(task_obj.describe())  # where the prompts come from, and how many the length limit dropped
        startup_line(
            "locating the starting checkpoint (a tiny model's is built once, into checkpoint.cache_dir)"
        )
        spec = PairSpec(
            model=model,
            precision=precision,
            algorithm=algorithm,
            trainer=trainer,
            rollout=rollout,
            placement=placement,
            checkpoint_path=_starting_checkpoint(model, task, checkpoint, placement.device),
            seed=seed,
            eos_token_id=task_obj.tokenizer.eos_token_id,
            rollout_checkpoint=checkpoint.rollout_checkpoint,
            parallel=topology.parallel,
            trainer_gpus=topology.trainer_gpus,
            checkpoint=checkpoint,
        )
        with worker_pair(spec, plan, placement_timeout_s=topology.placement_timeout_s) as pair:
            res = pair.resolution
            print(
                f"workers agree: fp8 recipe {res.fp8_recipe.value}, scales {res.scale_format.value}"
                + (
                    " (no GPU: exact emulation)"
                    if res.capability is None
                    else f" on SM{res.capability[0]}{res.capability[1]}"
                )
            )
            if resume:
                pair.restore(ckpt_dir, state)
            _loop(pair, task_obj, run_dir, ckpt_root, start_step,
                  algorithm=algorithm, task_cfg=task, rollout=rollout, logger=logger,
                  checkpoint=checkpoint, seed=seed, wandb_config=redact(config_container))  # fmt: skip
    finally:
        release_run_dir(run_dir)
    rows = read_metrics(run_dir / METRICS_FILE)
    if logger.plot and rows:
        plot_run(rows, run_dir / PLOT_FILE, title=f"{precision.name.value} - {run_dir.name}")
    rewards = [r["reward"] for r in rows]
    return RunResult(
        run_dir=run_dir,
        start_step=start_step,
        num_steps=algorithm.num_steps,
        weight_version=rows[-1]["weight_version"] if rows else 0,
        reward_first=sum(rewards[:10]) / max(len(rewards[:10]), 1),
        reward_last=sum(rewards[-10:]) / max(len(rewards[-10:]), 1),
        wall_s=time.perf_counter() - started,
    )


def _starting_checkpoint(
    model: ModelConfig, task: TaskConfig, checkpoint: CheckpointConfig, device: str
) -> str:
    if checkpoint.hf_checkpoint is not None:
        return checkpoint.hf_checkpoint
    from skyq.trainer.native.tiny_checkpoint import ensure_tiny_checkpoint

    return str(ensure_tiny_checkpoint(model, task, cache_dir=checkpoint.cache_dir, device=device))


def _loop(
    pair: WorkerPair,
    task: Task,
    run_dir: Path,
    ckpt_root: Path,
    start_step: int,
    *,
    algorithm: AlgorithmConfig,
    task_cfg: TaskConfig,
    rollout: RolloutConfig,
    logger: LoggerConfig,
    checkpoint: CheckpointConfig,
    seed: int,
    wandb_config: dict[str, Any],
) -> None:
    interval = checkpoint.save_interval
    guard = MismatchGuard(algorithm.max_mismatch, algorithm.mismatch_patience)
    with MetricsLogger(
        run_dir / METRICS_FILE,
        logger_cfg=logger,
        wandb_config=wandb_config,
        run_name=run_dir.name,
        num_steps=algorithm.num_steps,
        start_step=start_step,
    ) as metrics:
        try:
            for step in range(start_step, algorithm.num_steps):
                # The first sync of every session (fresh or resumed) is checked bit for bit.
                row = run_step(pair, task, step, algorithm=algorithm, task_cfg=task_cfg, rollout=rollout,
                               seed=seed, verify_sync=step == start_step)  # fmt: skip
                metrics.log(row)
                guard.observe(step, row["mismatch/mean_abs_dlogp"])  # before a checkpoint could save it
                last = step + 1 == algorithm.num_steps
                if last or (interval > 0 and (step + 1) % interval == 0):
                    if checkpoint.async_save:  # snapshot now, written while the next steps run
                        pair.start_checkpoint(ckpt_root, next_step=step + 1, seed=seed)
                    else:
                        pair.save_checkpoint(ckpt_root, next_step=step + 1, seed=seed)
        except BaseException as exc:
            # A run that fails still completes the checkpoint it began (as a synchronous save
            # would have), unless the trainer itself stopped answering; only a kill leaves just
            # its hidden temp dir.
            if not (isinstance(exc, WorkerTimeout) and exc.worker.startswith("trainer")):
                try:
                    pair.finish_checkpoint()
                except Exception as unsaved:
                    exc.add_note(f"also: {unsaved}")
            raise
        pair.finish_checkpoint()  # the end of the run: its last checkpoint is complete on return
