"""Per-worker resolution of hardware-dependent settings.

`fp8_recipe=auto` and the scale format are resolved on each worker from its own device capability;
the driver collects the workers' resolutions and refuses disagreement. Everything downstream of the
recipe (sequence-packing alignment, wire format, env vars) is computed from the agreed resolution,
never guessed on the driver. A process with no GPU (capability None) leaves `auto` unresolved.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

from skyq.config.enums import Device, Fp8Recipe, Precision, ScaleFormat, TransportKind
from skyq.config.schema import PrecisionConfig, TopologyConfig

Capability = Optional[tuple[int, int]]
"""CUDA compute capability (major, minor), or None for a CPU-only process."""

BLACKWELL = (10, 0)


class ResolutionError(ValueError):
    """A worker cannot run the configured recipe, or workers resolved differently."""


@dataclass(frozen=True)
class WorkerResolution:
    capability: Capability
    """The device capability the worker reported (None = no GPU)."""
    fp8_recipe: Fp8Recipe
    """The recipe this worker will run (`auto` only when there is no GPU)."""
    scale_format: ScaleFormat
    """FP8 blockwise scale format this worker will use."""
    emulated: bool
    """The recipe runs as exact emulation (no native instructions)."""

    def agrees_with(self, other: WorkerResolution) -> bool:
        return (self.fp8_recipe, self.scale_format) == (other.fp8_recipe, other.scale_format)


def resolve_worker(precision: PrecisionConfig, capability: Capability) -> WorkerResolution:
    """Resolve recipe and scale format for one worker from its device capability (a pure function)."""
    recipe = precision.fp8_recipe
    if precision.name is Precision.mxfp8:
        recipe = Fp8Recipe.mxfp8
    elif precision.name in (Precision.bf16, Precision.int4_qat):
        recipe = Fp8Recipe.auto if capability is None else recipe
    if capability is None:
        return WorkerResolution(None, recipe, precision.scale_format, emulated=True)
    if recipe is Fp8Recipe.auto:
        recipe = Fp8Recipe.mxfp8 if capability >= BLACKWELL else Fp8Recipe.blockwise
    emulated = False
    if recipe is Fp8Recipe.mxfp8 and capability < BLACKWELL:
        if not precision.emulate:
            raise ResolutionError(
                f"precision.fp8_recipe resolves to mxfp8 on a worker with compute capability "
                f"{capability[0]}.{capability[1]} (MXFP8 needs SM100+). Fix: precision=fp8_blockwise, or "
                "precision.emulate=true to run it as exact (slow) emulation."
            )
        emulated = True
    scale = precision.scale_format
    if recipe is Fp8Recipe.blockwise and capability >= BLACKWELL:
        # Blackwell's blockwise GEMMs (DeepGEMM, TE) take power-of-two scales only.
        scale = ScaleFormat.ue8m0
    return WorkerResolution(capability, recipe, scale, emulated)


def agree(resolutions: Sequence[WorkerResolution]) -> WorkerResolution:
    """The one resolution all workers share; refuse any disagreement before the first step."""
    if not resolutions:
        raise ResolutionError("no worker reported its resolution")
    first = resolutions[0]
    for i, other in enumerate(resolutions[1:], start=1):
        if not first.agrees_with(other):
            raise ResolutionError(
                f"workers resolved precision differently: worker 0 (capability {first.capability}) -> "
                f"{first.fp8_recipe.value}/{first.scale_format.value}, worker {i} (capability {other.capability}) -> "
                f"{other.fp8_recipe.value}/{other.scale_format.value}. Mixed GPU generations cannot share one "
                "recipe; set precision.fp8_recipe and precision.scale_format explicitly."
            )
    return first


def packing_alignment(precision: PrecisionConfig, resolved: WorkerResolution, *, tp: int, cp: int) -> int:
    """Sequence-packing alignment in tokens, from the recipe the workers actually resolved."""
    if precision.name is Precision.bf16 or precision.name is Precision.int4_qat:
        return tp * cp
    if resolved.fp8_recipe is Fp8Recipe.auto:
        raise ResolutionError(
            "packing alignment needs a resolved fp8 recipe; precision.fp8_recipe=auto is resolved only on GPU "
            "workers. Ask the workers (resolve_worker) first."
        )
    if resolved.fp8_recipe is Fp8Recipe.mxfp8:
        return 32 * tp * cp
    return 128 * tp * cp if tp > 1 else 16 * cp


# driver-level: the sync transport is a fact of the placement, the same on every worker


def total_gpus(topology: TopologyConfig) -> int:
    return 0 if Device(topology.device) is Device.cpu else topology.num_nodes * topology.gpus_per_node


def resolve_transport(topology: TopologyConfig, transport: TransportKind) -> TransportKind:
    """`auto` -> in_process on exactly one GPU, broadcast otherwise; refuse what cannot work here."""
    transport = TransportKind(transport)
    gpus = total_gpus(topology)
    if transport is TransportKind.auto:
        return TransportKind.in_process if gpus == 1 else TransportKind.broadcast
    if transport is TransportKind.cuda_ipc:
        raise ValueError(
            "rollout.weight_sync.transport=cuda_ipc: the embedded run does not use CUDA IPC (its trainer and "
            "engine share one process on one GPU, or sit on separate devices). Use auto."
        )
    if transport is TransportKind.in_process and gpus > 1:
        raise ValueError(
            f"rollout.weight_sync.transport=in_process puts the trainer and the engine in one process on one "
            f"device, but topology={topology.name} has {gpus} GPUs (one worker per GPU, synced over NCCL). "
            "Use transport=auto or broadcast, or topology=1gpu."
        )
    return transport
