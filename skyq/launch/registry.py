"""Which worker classes run a (trainer backend, rollout backend) pair: the run loop's one lookup.

The loop (`skyq.launch.loop`) drives a trainer worker and a group of rollout-engine workers through
the `TrainerWorkerApi` / `RolloutWorkerApi` protocols (`skyq.launch.protocols`) and knows no backend.
A backend is one package plus one `register` line here; its classes are named by import path and
imported only when a run uses them, so a heavy stack (vLLM, Megatron-core) is imported by the runs
that chose it and by nothing else.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from skyq.config.enums import RolloutBackend, TrainerBackend

if TYPE_CHECKING:
    from skyq.launch.pair import PairSpec


@dataclass(frozen=True, slots=True)
class WorkerBackends:
    """The classes of one (trainer, rollout) pair, as `module:Class` import paths.

    Each class takes keyword arguments only; `trainer_kwargs` / `engine_kwargs` are the functions
    (also `module:function`) that derive those arguments from a `PairSpec`."""

    trainer: str
    engine: str
    trainer_kwargs: str
    engine_kwargs: str
    in_process: bool = True
    """Whether the pair can share the driver's process (the one-GPU layout); a backend that owns its
    process (vLLM's engine core) runs as Ray actors only."""
    device_sync: bool = True
    """Whether the engine can receive sync frames on its GPU (NCCL); False: over gloo through host
    memory whatever the placement (skyq's vLLM transfer today)."""

    def trainer_class(self) -> type:
        """The trainer worker class, checked against `TrainerWorkerApi`."""
        from skyq.launch.protocols import TrainerWorkerApi, check_conforms

        cls = load(self.trainer)
        check_conforms(cls, TrainerWorkerApi, "trainer worker")
        return cls

    def engine_class(self) -> type:
        """The rollout worker class, checked against `RolloutWorkerApi`."""
        from skyq.launch.protocols import RolloutWorkerApi, check_conforms

        cls = load(self.engine)
        check_conforms(cls, RolloutWorkerApi, "rollout worker")
        return cls

    def trainer_arguments(self, spec: PairSpec) -> dict[str, Any]:
        return load(self.trainer_kwargs)(spec)

    def engine_arguments(self, spec: PairSpec, index: int) -> dict[str, Any]:
        """Arguments of engine `index` (0-based) of the rollout group."""
        return load(self.engine_kwargs)(spec, index)


_REGISTRY: dict[tuple[TrainerBackend, RolloutBackend], WorkerBackends] = {}


def register(trainer: TrainerBackend, rollout: RolloutBackend, backends: WorkerBackends) -> None:
    """Make `trainer=<trainer> rollout=<rollout>` runnable with `backends`' classes."""
    _REGISTRY[(TrainerBackend(trainer), RolloutBackend(rollout))] = backends


def lookup(trainer: TrainerBackend, rollout: RolloutBackend) -> WorkerBackends:
    """The registered classes of the pair, or a `ValueError` that lists the pairs this build runs."""
    key = (TrainerBackend(trainer), RolloutBackend(rollout))
    try:
        return _REGISTRY[key]
    except KeyError:
        have = ", ".join(f"trainer={t.value} rollout={r.value}" for t, r in sorted(_REGISTRY, key=str))
        raise ValueError(
            f"trainer={key[0].value} rollout={key[1].value}: this build of skyq has no workers for that pair "
            f"(it runs {have}); pick one of those, or add dry_run=true to print the plan"
        ) from None


def registered() -> list[tuple[TrainerBackend, RolloutBackend]]:
    """Every runnable (trainer, rollout) pair."""
    return list(_REGISTRY)


def load(path: str) -> Callable[..., Any]:
    """The object at `module:attribute`."""
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


register(
    TrainerBackend.torch,
    RolloutBackend.embedded,
    WorkerBackends(
        trainer="skyq.launch.actors:TrainerWorker",
        engine="skyq.launch.actors:EngineWorker",
        trainer_kwargs="skyq.launch.pair:native_trainer_kwargs",
        engine_kwargs="skyq.launch.pair:embedded_engine_kwargs",
    ),
)
register(
    TrainerBackend.torch,
    RolloutBackend.vllm,
    WorkerBackends(
        trainer="skyq.launch.actors:TrainerWorker",
        engine="skyq.rollout.vllm.worker:VllmEngineWorker",
        trainer_kwargs="skyq.launch.pair:native_trainer_kwargs",
        engine_kwargs="skyq.launch.pair:vllm_engine_kwargs",
        in_process=False,
        device_sync=False,
    ),
)
register(
    TrainerBackend.megatron,
    RolloutBackend.embedded,
    WorkerBackends(
        trainer="skyq.trainer.megatron.worker:MegatronTrainerWorker",
        engine="skyq.launch.actors:EngineWorker",
        trainer_kwargs="skyq.launch.pair:megatron_trainer_kwargs",
        engine_kwargs="skyq.launch.pair:embedded_engine_kwargs",
        in_process=False,
    ),
)
register(
    TrainerBackend.megatron,
    RolloutBackend.vllm,
    WorkerBackends(
        trainer="skyq.trainer.megatron.worker:MegatronTrainerWorker",
        engine="skyq.rollout.vllm.worker:VllmEngineWorker",
        trainer_kwargs="skyq.launch.pair:megatron_trainer_kwargs",
        engine_kwargs="skyq.launch.pair:vllm_engine_kwargs",
        in_process=False,
        device_sync=False,
    ),
)
