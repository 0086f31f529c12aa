"""What the RL loop drives: a trainer worker and an engine worker joined by a weight-sync channel.

Two implementations: `ActorPair` (two Ray actors; CPU runs and one worker per GPU) and `LocalPair`
(both workers in the driver process sharing one GPU). The loop sees only this interface; the
checks that do not depend on where the workers live are written once, here.
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from skyq.config.resolve import WorkerResolution
from skyq.config.schema import (
    AlgorithmConfig,
    CheckpointConfig,
    ModelConfig,
    ParallelConfig,
    PrecisionConfig,
    RolloutConfig,
    TrainerConfig,
    WeightSyncConfig,
)
from skyq.launch.checkpointing import (
    TRAINER_STATE,
    PendingCheckpoint,
    RunCheckpointError,
    RunState,
    begin_run_checkpoint,
    save_run_checkpoint,
)
from skyq.launch.placement import Placement
from skyq.launch.registry import WorkerBackends, lookup
from skyq.rl.batch import RolloutBatch, Sample
from skyq.sync.errors import SyncError


@dataclass(frozen=True, slots=True)
class PairSpec:
    """Everything both pair kinds build their two workers from."""

    model: ModelConfig
    precision: PrecisionConfig
    algorithm: AlgorithmConfig
    trainer: TrainerConfig
    rollout: RolloutConfig
    placement: Placement
    checkpoint_path: str
    seed: int
    eos_token_id: int
    """The task tokenizer's end of response: engines stop a sample there."""
    rollout_checkpoint: str | None = None
    """`checkpoint.rollout_checkpoint`: a converted checkpoint the engines boot from (vLLM, embedded)."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """`topology.parallel`: the Megatron trainer's layout."""
    trainer_gpus: int = 0
    """`topology.trainer_gpus` (the Megatron trainer's world on GPUs)."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """The checkpoint section (`load` / `ref_load` boot the Megatron trainer)."""

    @property
    def num_engines(self) -> int:
        """Engines in the rollout group (`rollout.num_engines`; unset: one, the most any placement of
        the embedded pair has room for)."""
        return self.rollout.num_engines or 1

    def backends(self) -> WorkerBackends:
        """The worker classes registered for `trainer.backend` x `rollout.backend`."""
        return lookup(self.trainer.backend, self.rollout.backend)

    def trainer_kwargs(self) -> dict[str, Any]:
        """Arguments of the trainer worker class of this spec's backends."""
        return self.backends().trainer_arguments(self)

    def engine_kwargs(self, index: int = 0) -> dict[str, Any]:
        """Arguments of engine `index` of the rollout group."""
        return self.backends().engine_arguments(self, index)


def native_trainer_kwargs(spec: PairSpec) -> dict[str, Any]:
    """Arguments of `TrainerWorker` (trainer=torch)."""
    return {
        "model_cfg": spec.model,
        "precision_cfg": spec.precision,
        "optimizer_cfg": spec.trainer.optimizer,
        "algorithm_cfg": spec.algorithm,
        "micro_batch_size": spec.trainer.micro_batch_size,
        "checkpoint_path": spec.checkpoint_path,
        "device": spec.placement.device,
        "seed": spec.seed,
        # log-probs of the policy the engine samples from (logits / rollout.temperature)
        "temperature": spec.rollout.temperature,
        "fp8_gemm": spec.trainer.fp8_gemm,
        "compute_dtype": spec.trainer.compute_dtype,
    }


def megatron_trainer_kwargs(spec: PairSpec) -> dict[str, Any]:
    """Arguments of `skyq.trainer.megatron.worker.MegatronTrainerWorker` (trainer=megatron)."""
    from skyq.launch.redaction import split_worker_env

    return {
        "model_cfg": spec.model,
        "precision_cfg": spec.precision,
        "trainer_cfg": spec.trainer,
        "algorithm_cfg": spec.algorithm,
        "parallel_cfg": spec.parallel,
        "checkpoint_path": spec.checkpoint_path,
        "load_path": spec.checkpoint.load,
        "ref_load": spec.checkpoint.ref_load,
        "device": spec.placement.device,
        "seed": spec.seed,
        "temperature": spec.rollout.temperature,
        "trainer_gpus": spec.trainer_gpus,
        # the peer ranks' actors get the trainer's non-secret variables (Ray logs runtime_env)
        "peer_env": split_worker_env(dict(spec.trainer.env))[0],
        # the secret ones by name only: rank 0 hands their values on through owner-only files
        "peer_secret_env_names": tuple(sorted(split_worker_env(dict(spec.trainer.env))[1])),
        "timeout_s": spec.rollout.weight_sync.worker_call_timeout_s,
    }


def embedded_engine_kwargs(spec: PairSpec, index: int) -> dict[str, Any]:
    """Arguments of `EngineWorker` (rollout=embedded); every engine of the group is built alike."""
    del index
    return {
        "model_cfg": spec.model,
        "precision_cfg": spec.precision,
        "device": spec.placement.device,
        "seed": spec.seed,
        "eos_token_id": spec.eos_token_id,
        "cuda_graphs": spec.rollout.cuda_graphs,
        "fp8_codes_decode": spec.rollout.fp8_codes_decode,
        "rollout_checkpoint": spec.rollout_checkpoint,
    }


def vllm_engine_kwargs(spec: PairSpec, index: int) -> dict[str, Any]:
    """Arguments of `skyq.rollout.vllm.worker.VllmEngineWorker` (rollout=vllm); engine `index` samples
    with its own seed (`engine_seed`), so two engines never draw the same stream."""
    return {
        "model_cfg": spec.model,
        "precision_cfg": spec.precision,
        "rollout_cfg": spec.rollout,
        "checkpoint_path": spec.checkpoint_path,
        "rollout_checkpoint": spec.rollout_checkpoint,
        "device": spec.placement.device,
        "seed": engine_seed(spec.seed, index),
        "eos_token_id": spec.eos_token_id,
    }


class WorkerPair(ABC):
    """A trainer worker and an engine worker (`skyq.launch.actors`), wherever they live."""

    sync_cfg: WeightSyncConfig
    num_engines: int = 1
    """Engines in the rollout group."""
    resolution: WorkerResolution
    """The precision resolution both workers reported and agreed on."""

    @abstractmethod
    def _call(self, side: str, method: str, *args: Any, **kwargs: Any) -> Any:
        """Call `method` on the "trainer" or "engine" worker and return its result."""

    @abstractmethod
    def sync(self, version: int) -> dict[str, float]:
        """One full weight sync as `version`; raises `SyncError` (with both sides' story) on failure."""

    @abstractmethod
    def shutdown(self) -> None:
        """End both workers and their sync channel."""

    def _call_engines(self, method: str, calls: list[tuple[tuple, dict]]) -> list[Any]:
        """Call `method` on every engine at once, engine i with `calls[i]` = (args, kwargs); their
        results in engine order. The default serves a group of one engine."""
        ((args, kwargs),) = calls
        return [self._call("engine", method, *args, **kwargs)]

    def verify_engine_matches_trainer(self) -> None:
        """Compare every engine's wire tensors with what the trainer's weights serialize to, bit for bit."""
        want = self._call("trainer", "serialized_digest")
        helds = self._call_engines("wire_digest", [((), {})] * self.num_engines)
        for name, held in zip(engine_names(self.num_engines), helds):
            differing = sorted(n for n in want.keys() | held.keys() if want.get(n) != held.get(n))
            if differing:
                raise SyncError(
                    f"after the sync the weights of {name.removesuffix(' actor')} differ from the trainer's in "
                    f"{len(differing)} tensors (first: {differing[:3]}); it is not serving the trainer's weights"
                )

    def generate(self, prompts: list[list[int]], *, seed: int, **sampling: Any) -> list[Sample]:
        """Samples of `prompts` in prompt order. With several engines the prompts are split into
        contiguous shares, one per engine, generated at once; engine 0 samples with `seed`, engine i
        with a seed derived from (seed, i), so a one-engine run draws exactly what it always drew."""
        n = self.num_engines
        if n == 1:
            return self._call("engine", "generate", prompts, seed=seed, **sampling)
        bounds = [len(prompts) * i // n for i in range(n + 1)]
        calls = [
            ((prompts[bounds[i] : bounds[i + 1]],), {"seed": engine_seed(seed, i), **sampling})
            for i in range(n)
        ]
        return [s for share in self._call_engines("generate", calls) for s in share]

    def train_step(self, batch: RolloutBatch) -> dict[str, float]:
        return self._call("trainer", "train_step", batch)

    _pending: PendingCheckpoint | None = None
    """The asynchronous checkpoint whose trainer.pt is being written, if any (one at a time)."""

    def save_checkpoint(self, root: Path, *, next_step: int, seed: int) -> Path:
        """Write a complete checkpoint now (`checkpoint.async_save=false`)."""
        self.finish_checkpoint()
        return save_run_checkpoint(
            root,
            next_step=next_step,
            seed=seed,
            write_trainer=lambda path: self._call("trainer", "save_state", str(path)),
        )

    def start_checkpoint(self, root: Path, *, next_step: int, seed: int) -> None:
        """Begin a checkpoint of the trainer's state as it is now; its trainer.pt is written in the
        background while the run goes on, and the trainer commits the checkpoint the moment the file
        is complete. The previous asynchronous one is waited for first."""
        self.finish_checkpoint()
        pending = PendingCheckpoint(root=root, tmp=begin_run_checkpoint(root, next_step), next_step=next_step, seed=seed)  # fmt: skip
        try:
            self._call("trainer", "start_save_state", pending)
        except BaseException:
            pending.abort()
            raise
        self._pending = pending

    def finish_checkpoint(self) -> Path | None:
        """Wait for the checkpoint `start_checkpoint` began (committed by the trainer once written);
        returns its directory, or None if none was in flight. A failed write raises
        `RunCheckpointError` naming the file and the error; the checkpoints before it are left as
        they were."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        try:
            return Path(self._call("trainer", "wait_save_state"))
        except Exception as exc:
            pending.abort()
            raise RunCheckpointError(
                f"the checkpoint of step {pending.next_step} was not saved: {self._describe_worker_error(exc)}. "
                f"The run stops rather than go on without checkpoints; the earlier ones under {pending.root} "
                "are intact (resume continues from the newest)"
            ) from exc

    def _describe_worker_error(self, exc: BaseException) -> str:
        """One line for an error a worker call raised."""
        return describe_error(exc)

    def restore(self, checkpoint_dir: Path, state: RunState) -> None:
        """Load the trainer state of a verified checkpoint (the engine is re-synced by the next sync)."""
        self.finish_checkpoint()
        trainer_step = self._call("trainer", "load_state", str(checkpoint_dir / TRAINER_STATE))
        if trainer_step != state.next_step:
            raise SyncError(
                f"{checkpoint_dir}: trainer state is at step {trainer_step}, the run state says {state.next_step}"
            )


def engine_names(num_engines: int) -> list[str]:
    """How errors and start-up lines name the engines: "engine actor", or "engine actor i" of several."""
    return ["engine actor"] if num_engines == 1 else [f"engine actor {i}" for i in range(num_engines)]


def engine_seed(seed: int, index: int) -> int:
    """Engine `index`'s sampling seed of a step whose seed is `seed` (engine 0 keeps `seed`)."""
    if index == 0:
        return seed
    digest = hashlib.sha256(f"skyq-engine:{seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def describe_error(exc: BaseException) -> str:
    """One line for an error: its type and the first line of its message."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"
