"""Where the embedded run's trainer and engine live, and how weights move between them.

Decided on the driver from the config alone (no device is touched): the transport is a fact of the
placement, so it cannot resolve differently on different workers.

    topology.device=cpu                  two Ray actors on the CPU, frames over gloo
    one GPU (topology=1gpu)              both workers in the driver process on that GPU, frames
                                         through an in-process channel (device-to-device copies)
    two GPUs or more                     two Ray actors, one GPU each, frames over NCCL

`rollout.weight_sync.transport=auto` picks the line above; `in_process` and `broadcast` force one
where it can work and are refused where it cannot.
"""

from __future__ import annotations

from dataclasses import dataclass

from skyq.config.enums import TransportKind
from skyq.config.resolve import resolve_transport, total_gpus
from skyq.config.schema import TopologyConfig


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
    if gpus >= 2:
        return Placement(device="cuda", trainer_gpus=1, engine_gpus=1, sync_device="cuda", transport=kind)
    # One GPU shared by two Ray actors: NCCL refuses two ranks on one device, so frames go through host memory.
    return Placement(device="cuda", trainer_gpus=0.5, engine_gpus=0.5, sync_device="cpu", transport=kind)


def describe(placement: Placement) -> str:
    """One line for the run's log and the dry run."""
    if placement.in_process:
        return (
            f"trainer and engine in this process on {placement.device}, weights through an in-process channel"
        )
    backend = "NCCL" if placement.sync_device == "cuda" else "gloo"
    return f"trainer and engine as two Ray actors on {placement.device}, weights over {backend}"
