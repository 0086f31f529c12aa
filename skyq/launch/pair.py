"""What the RL loop drives: a trainer worker and an engine worker joined by a weight-sync channel.

Two implementations: `ActorPair` (two Ray actors; CPU runs and one worker per GPU) and `LocalPair`
(both workers in the driver process sharing one GPU). The loop sees only this interface; the
checks that do not depend on where the workers live are written once, here.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from skyq.config.resolve import WorkerResolution
from skyq.config.schema import (
    AlgorithmConfig,
    ModelConfig,
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

    def trainer_kwargs(self) -> dict[str, Any]:
        """Arguments of `TrainerWorker`."""
        return {
            "model_cfg": self.model,
            "precision_cfg": self.precision,
            "optimizer_cfg": self.trainer.optimizer,
            "algorithm_cfg": self.algorithm,
            "micro_batch_size": self.trainer.micro_batch_size,
            "checkpoint_path": self.checkpoint_path,
            "device": self.placement.device,
            "seed": self.seed,
            # log-probs of the policy the engine samples from (logits / rollout.temperature)
            "temperature": self.rollout.temperature,
            "fp8_gemm": self.trainer.fp8_gemm,
            "compute_dtype": self.trainer.compute_dtype,
        }

    def engine_kwargs(self) -> dict[str, Any]:
        """Arguments of `EngineWorker`."""
        return {
            "model_cfg": self.model,
            "precision_cfg": self.precision,
            "device": self.placement.device,
            "seed": self.seed,
            "cuda_graphs": self.rollout.cuda_graphs,
            "fp8_codes_decode": self.rollout.fp8_codes_decode,
        }


class WorkerPair(ABC):
    """A trainer worker and an engine worker (`skyq.launch.actors`), wherever they live."""

    sync_cfg: WeightSyncConfig
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

    def verify_engine_matches_trainer(self) -> None:
        """Compare the engine's wire tensors with what the trainer's weights serialize to, bit for bit."""
        want = self._call("trainer", "serialized_digest")
        held = self._call("engine", "wire_digest")
        differing = sorted(n for n in want.keys() | held.keys() if want.get(n) != held.get(n))
        if differing:
            raise SyncError(
                f"after the sync the engine's weights differ from the trainer's in {len(differing)} tensors "
                f"(first: {differing[:3]}); the engine is not serving the trainer's weights"
            )

    def generate(self, prompts: list[list[int]], **sampling: Any) -> list[Sample]:
        return self._call("engine", "generate", prompts, **sampling)

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


def describe_error(exc: BaseException) -> str:
    """One line for an error: its type and the first line of its message."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"
