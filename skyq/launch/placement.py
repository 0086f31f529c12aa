"""Where the embedded run's trainer and engine live, and how weights move between them.

Decided on the driver from the config alone (no device is touched): the transport is a fact of the
placement, so it cannot resolve differently on different workers.

    topology.device=cpu                  Ray actors on the CPU, frames over gloo
    one GPU (topology=1gpu)              both workers in the driver process on that GPU, frames
                                         through an in-process channel (device-to-device copies)
    two GPUs or more, split              Ray actors, one GPU each, frames over NCCL
    colocated, Ray actors                trainer rank 0 and an engine share a GPU: frames over gloo

Where the Ray actors go is the placement plan's (`skyq.launch.plan`; `ActorPair` reserves its
placement group through `skyq.launch.probe`); `Placement` keeps what the driver decides before that:
in process or not, the device kind and the sync's device.

`rollout.weight_sync.transport=auto` picks the line above; `in_process` and `broadcast` force one
where it can work and are refused where it cannot.

`describe_plan` prints the placement plan (`skyq.launch.plan`) of every run whose workers are Ray
actors, as the dry run and the run itself print it: one placement group, the trainer ranks and the
engines' GPUs (or CPU shares), their sync groups and env.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from skyq.config.enums import Device, RolloutBackend, TransportKind
from skyq.config.enums import Placement as PlacementLayout
from skyq.config.resolve import resolve_transport, total_gpus
from skyq.config.schema import RolloutConfig, TopologyConfig, TrainerConfig
from skyq.launch.plan import (
    CPUS_PER_BUNDLE,
    ENGINE,
    ENGINE_WORKER,
    ENGINE_WORKER_COLOCATED_GPUS,
    NOSET_VISIBLE_DEVICES,
    TRAINER,
    TRAINER_COLOCATED_GPUS,
    PlacementPlan,
    plan_placement,
)
from skyq.launch.registry import lookup


@dataclass(frozen=True, slots=True)
class Placement:
    """Where the two workers compute and how sync frames move between them."""

    device: str
    trainer_gpus: float
    engine_gpus: float
    sync_device: str
    transport: TransportKind
    """`in_process` (both workers in the driver process, no Ray) or `broadcast` (two Ray actors)."""

    @property
    def in_process(self) -> bool:
        return self.transport is TransportKind.in_process


def placement_for(topology: TopologyConfig, transport: TransportKind = TransportKind.auto) -> Placement:
    """The embedded run's placement for `topology` and `rollout.weight_sync.transport`."""
    kind = resolve_transport(topology, transport)
    gpus = total_gpus(topology)
    if gpus == 0:
        return Placement(device="cpu", trainer_gpus=0, engine_gpus=0, sync_device="cpu", transport=kind)
    if kind is TransportKind.in_process:
        return Placement(device="cuda", trainer_gpus=1, engine_gpus=1, sync_device="cuda", transport=kind)
    if gpus >= 2 and topology.placement is not PlacementLayout.colocated:
        return Placement(device="cuda", trainer_gpus=1, engine_gpus=1, sync_device="cuda", transport=kind)
    # Trainer rank 0 and an engine on one GPU (the plan's colocated bundle, fractions of it): NCCL refuses
    # two ranks on one device, so frames go through host memory.
    return Placement(
        device="cuda",
        trainer_gpus=TRAINER_COLOCATED_GPUS,
        engine_gpus=ENGINE_WORKER_COLOCATED_GPUS,
        sync_device="cpu",
        transport=kind,
    )


def describe(placement: Placement) -> str:
    """One line for the run's log and the dry run."""
    if placement.in_process:
        return (
            f"trainer and engine in this process on {placement.device}, weights through an in-process channel"
        )
    backend = "NCCL" if placement.sync_device == "cuda" else "gloo"
    return f"the trainer and engine actors on {placement.device}, weights over {backend}"


def describe_plan(plan: PlacementPlan) -> str:
    """The placement plan as the dry run and the simulation print it: in slots (node-major GPU
    positions), so it reads the same before and after the probe binds slots to bundles."""
    tp, pp, cp, dp = plan.parallel
    ep, etp = plan.expert_parallel
    if plan.device is Device.cpu:
        world, n = len(plan.trainer), len(plan.engines)
        return "\n".join(
            [
                f"placement plan: CPU; one placement group of {plan.num_slots} bundles (CPU only), PACK, on "
                "the local Ray cluster",
                f"  trainer: {world} rank(s) TP{tp} PP{pp} CP{cp} DP{dp} EP{ep} ETP{etp} on bundles "
                f"{_span(range(world))}, {plan.slot_cpus(0):g} CPU each",
                f"  rollout: {n} {plan.rollout_backend.value} engine(s) on bundles {_span(range(world, world + n))}, "
                f"{plan.slot_cpus(world):g} CPU each",
            ]
        )
    gpn, gpe, slots = plan.gpus_per_node, plan.gpus_per_engine, plan.num_slots
    vllm = plan.rollout_backend is RolloutBackend.vllm
    lines = [
        f"placement plan: {plan.num_nodes} node(s) x {gpn} GPUs, {plan.layout.value}; one placement group of "
        f'{slots} bundles {{"GPU": 1, "CPU": {CPUS_PER_BUNDLE}}}, PACK; slot = node * {gpn} + GPU, bundles '
        "re-sorted by (node IP, GPU id) at start",
        f"  trainer: {len(plan.trainer)} rank(s) TP{tp} PP{pp} CP{cp} DP{dp} EP{ep} ETP{etp} (rank order tp, cp, dp, pp) on slots "
        f"{_span([r.slot for r in plan.trainer])}, rank r on slot {plan.trainer[0].slot} + r, "
        f"{plan.num_gpus(TRAINER):g} GPU each; CUDA_VISIBLE_DEVICES = its GPU (set by Ray)",
    ]
    if plan.vllm_ray_workers:
        lines.append(
            f"  rollout: {len(plan.engines)} vLLM engine(s) x {gpe} GPU(s), {plan.num_gpus(ENGINE_WORKER):g} GPU per "
            "worker; each engine an actor without a GPU on its first slot, its workers started by vLLM's Ray "
            "executor on VLLM_RAY_BUNDLE_INDICES"
        )
    else:
        inside = "vLLM in the actor's process (its uni executor, device 0), " if vllm else ""
        lines.append(
            f"  rollout: {len(plan.engines)} {plan.rollout_backend.value} engine(s) x 1 GPU, "
            f"{plan.num_gpus(ENGINE):g} GPU each; {inside}CUDA_VISIBLE_DEVICES = its GPU (set by Ray)"
        )
    shown = plan.engines if len(plan.engines) <= 32 else (*plan.engines[:16], None, *plan.engines[-8:])
    for e in shown:
        if e is None:
            lines.append(f"    ... ({len(plan.engines) - 24} more)")
            continue
        nodes = sorted({plan.node(s) for s in e.slots})
        per_node = "" if len(nodes) == 1 else f", {len(e.node_groups[0])} workers per node"
        lines.append(
            f"    engine {e.index}: slots {_span(e.slots)} (node {_span(nodes)}{per_node}); sync group world "
            f"{e.sync_world_size} = trainer rank 0 + workers at ranks {_span(range(e.sync_rank_offset, e.sync_world_size))}; "
            f"one-group offset {e.global_sync_rank_offset}"
        )
    if plan.vllm_ray_workers:
        lines.append(
            f"  env set at spawn: engine actor: {NOSET_VISIBLE_DEVICES}=1 VLLM_RAY_BUNDLE_INDICES=<the bundles of its "
            f"slots> VLLM_RAY_PER_WORKER_GPUS={plan.num_gpus(ENGINE_WORKER):g}; vLLM worker: CUDA_VISIBLE_DEVICES = the "
            "engine's GPUs on its node (set by vLLM), device = its local rank; plus trainer.env / rollout.env and "
            "the variables of the precision the workers resolve (below)"
        )
    return "\n".join(lines)


def _span(values) -> str:
    values = list(values)
    return f"{values[0]}" if len(values) == 1 else f"{values[0]}-{values[-1]}"


def worker_transport(trainer: TrainerConfig, rollout: RolloutConfig) -> TransportKind:
    """`rollout.weight_sync.transport`, except that `auto` never picks the in-process layout for a
    backend pair that cannot share the driver's process (vLLM owns its engine process): its workers
    are Ray actors, on one GPU too (frames through host memory)."""
    transport = TransportKind(rollout.weight_sync.transport)
    backends = lookup(trainer.backend, rollout.backend)
    if backends.in_process:
        return transport
    if transport is TransportKind.in_process:
        raise ValueError(
            f"rollout.weight_sync.transport=in_process: rollout={rollout.backend.value} runs each engine in "
            "its own Ray actor; use transport=auto or broadcast"
        )
    return TransportKind.broadcast


def run_placement(topology: TopologyConfig, trainer: TrainerConfig, rollout: RolloutConfig) -> Placement:
    """Where the run's workers live and how frames move, for the chosen backend pair: the topology's
    placement, Ray actors for a backend that cannot share the driver's process, and frames through
    host memory for an engine that cannot receive them on its GPU."""
    placement = placement_for(topology, worker_transport(trainer, rollout))
    if not lookup(trainer.backend, rollout.backend).device_sync:
        placement = dataclasses.replace(placement, sync_device="cpu")
    return placement


def run_plan(
    topology: TopologyConfig, trainer: TrainerConfig, rollout: RolloutConfig
) -> PlacementPlan | None:
    """The placement plan of a run whose workers are Ray actors (None: both in this process), as
    the dry run prints it and `ActorPair` reserves it."""
    if run_placement(topology, trainer, rollout).in_process:
        return None
    return plan_placement(topology=topology, rollout=rollout, trainer=trainer)
