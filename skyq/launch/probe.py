"""Two-phase start: reserve the plan's placement group, probe every bundle's device, bind, resolve;
only then may the backends spawn their workers (`placement`).

1. `reserve`: one PACK placement group of the plan's bundles, ready within a deadline, or a
   `PlacementError` naming what was asked and what the cluster has (a fixed cluster never grows:
   waiting forever, as slime does, only hides the mistake).
2. `probe_bundles`: a light task on each bundle (`PROBE_GPUS` of its GPU) reports node IP, hostname,
   GPU id and device capability.
3. `bind`: bundles sorted by (node IP, GPU id), slot s bound to the s-th (slime's re-sort), after
   checking every node holds whole nodes' worth of bundles (else a node-major slot would lie).
4. `resolve`: `resolve_worker` per GPU from its capability, `agree` across all of them, and the
   precision's env vars for the agreed recipe merged into the plan (user env wins), so each worker
   starts with its final env: Transformer Engine and vLLM read theirs at import.
The stand-ins of `skyq.launch.simulate` run this same code on a logical cluster. A CPU plan is
reserved the same way (its bundles hold CPUs only) but has no device to probe: its slots keep
their bundles and learn their nodes from Ray's placement-group table.

A worker that starts workers of its own (the Megatron trainer's rank 0 starts the other ranks) is
handed its `StartedPlacement` at construction (`set_actor_placement`, in that actor's process) and
places them with `actor_placement().actor_options(...)`.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from skyq.config.enums import Device, Fp8Recipe
from skyq.config.resolve import (
    Capability,
    ResolutionError,
    WorkerResolution,
    agree,
    packing_alignment,
    resolve_worker,
)
from skyq.config.schema import PrecisionConfig
from skyq.launch.plan import PROBE_GPUS, PlacementPlan


class PlacementError(RuntimeError):
    """The cluster cannot hold the plan (in time), or the placement group landed in a shape the plan
    cannot use; the message says what was asked and what the cluster has."""


@dataclass(frozen=True, slots=True)
class ProbeReport:
    bundle: int
    node_ip: str
    hostname: str
    gpu_id: int
    """The GPU's id on its node (what Ray assigned the probe)."""
    capability: Capability


@dataclass(frozen=True, slots=True)
class StartedPlacement:
    """What the backends spawn from: `plan.actor_options(role, i, placement_group)`."""

    placement_group: Any
    plan: PlacementPlan
    """Bound to the bundles and carrying every worker's final env."""
    resolution: WorkerResolution | None
    """The agreed resolution (None on a CPU plan: resolved by the workers themselves)."""
    reports: tuple[ProbeReport, ...]
    packing_alignment: int | None = None
    """Sequence-packing alignment in tokens from the agreed recipe (None where nothing resolved)."""

    def actor_options(self, role: str, index: int) -> dict[str, Any]:
        return self.plan.actor_options(role, index, self.placement_group)


_ACTOR_PLACEMENT: StartedPlacement | None = None


def set_actor_placement(started: StartedPlacement | None) -> None:
    """Record, in a worker actor's process, the placement it was started from."""
    global _ACTOR_PLACEMENT
    _ACTOR_PLACEMENT = started


def actor_placement() -> StartedPlacement | None:
    """The placement this process's worker was started from (None: not started from a plan, e.g.
    a worker built in the driver's process or by a test)."""
    return _ACTOR_PLACEMENT


def device_report(bundle: int) -> ProbeReport:
    """Runs in the probe task: where it landed and what device it sees (Ray has set its
    CUDA_VISIBLE_DEVICES to the bundle's GPU, so device 0 is that GPU)."""
    import ray
    import torch

    return ProbeReport(
        bundle=bundle,
        node_ip=ray.util.get_node_ip_address(),
        hostname=socket.gethostname(),
        gpu_id=int(ray.get_gpu_ids()[0]),
        capability=tuple(torch.cuda.get_device_capability(0)),  # type: ignore[arg-type]
    )


def reserve(plan: PlacementPlan, *, timeout_s: float, name: str = "") -> Any:
    """The plan's placement group, ready; `PlacementError` (and nothing left reserved) past `timeout_s`."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    pg = placement_group(plan.bundles, strategy="PACK", name=name)
    try:
        ray.get(pg.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(pg)
        raise PlacementError(
            f"placement group not ready within {timeout_s:g} s (topology.placement_timeout_s): asked "
            f"{len(plan.bundles)} bundles {plan.bundles[0]} (PACK) = {_counts(_sum(plan.bundles))} for "
            f"{_shape(plan)}; the cluster has {cluster_summary()}. "
            "Fix: a topology that fits the cluster, or free its GPUs (another job's placement group?)."
        ) from None
    except BaseException:
        remove_placement_group(pg)
        raise
    return pg


def cluster_summary() -> str:
    """What the Ray cluster has: totals, what is free, and per alive node its GPUs and CPUs."""
    import ray

    nodes = [n for n in ray.nodes() if n.get("Alive")]
    per_node = ", ".join(
        f"{n['NodeManagerAddress']}: {n['Resources'].get('GPU', 0):g} GPU {n['Resources'].get('CPU', 0):g} CPU"
        for n in nodes[:8]
    ) + (f", ... ({len(nodes)} nodes)" if len(nodes) > 8 else "")
    return (
        f"{_counts(ray.cluster_resources())} in all, {_counts(ray.available_resources())} free, "
        f"{len(nodes)} node(s) ({per_node})"
    )


def probe_bundles(
    pg: Any,
    plan: PlacementPlan,
    *,
    timeout_s: float,
    report: Callable[..., ProbeReport] = device_report,
    report_args: tuple = (),
    window: int | None = None,
) -> list[ProbeReport]:
    """One probe task per bundle (at most `window` at once; None: all at once); each returns
    `report(bundle, *report_args)` from where it ran."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    task = ray.remote(report)

    def call(b: int) -> Callable[[], Any]:
        strategy = PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=b)
        return lambda: task.options(num_cpus=0, num_gpus=PROBE_GPUS, scheduling_strategy=strategy).remote(
            b, *report_args
        )

    try:
        return gather([call(b) for b in range(len(plan.bundles))], timeout_s=timeout_s, window=window)
    except ray.exceptions.GetTimeoutError:
        raise PlacementError(
            f"the device probe of {len(plan.bundles)} bundles did not finish within {timeout_s:g} s"
        ) from None


def gather(calls: list[Callable[[], Any]], *, timeout_s: float, window: int | None = None) -> list[Any]:
    """Results of the Ray calls `calls` (each submits one and returns its ref), in order, at most
    `window` in flight (None: all at once); GetTimeoutError, the rest cancelled, past `timeout_s`.
    A window keeps a one-machine simulation from starting a worker process per pending task."""
    import time

    import ray

    deadline = time.monotonic() + timeout_s
    results: list[Any] = [None] * len(calls)
    pending = list(enumerate(calls))
    in_flight: dict[Any, int] = {}
    try:
        while pending or in_flight:
            while pending and (window is None or len(in_flight) < window):
                i, submit = pending.pop(0)
                in_flight[submit()] = i
            done, _ = ray.wait(list(in_flight), num_returns=1, timeout=max(deadline - time.monotonic(), 0))
            if not done:
                raise ray.exceptions.GetTimeoutError(f"{len(in_flight) + len(pending)} call(s) unfinished")
            for ref in done:
                results[in_flight.pop(ref)] = ray.get(ref)
    finally:
        for ref in in_flight:
            ray.cancel(ref, force=True)
    return results


def bind(plan: PlacementPlan, reports: list[ProbeReport]) -> PlacementPlan:
    """`plan` with slot s on the s-th bundle in (node IP, GPU id) order; refuses a placement group
    whose bundles are not whole nodes of gpus_per_node (a slot's node would be wrong)."""
    import dataclasses

    ordered = sorted(reports, key=lambda r: (ipaddress.ip_address(r.node_ip), r.gpu_id))
    per_node = Counter(r.node_ip for r in ordered)
    gpn = plan.gpus_per_node
    uneven = {ip: n for ip, n in per_node.items() if n != gpn}
    if len(per_node) != plan.num_nodes or uneven:
        raise PlacementError(
            f"the placement group's {len(ordered)} bundles landed on {len(per_node)} node(s) "
            f"({', '.join(f'{ip}: {n}' for ip, n in sorted(per_node.items())[:8])}); the plan needs "
            f"{plan.num_nodes} node(s) with {gpn} bundles each, or an engine or TP group would straddle nodes. "
            "Fix: free whole nodes for the run, or a topology matching the nodes it gets."
        )
    twice = [gpu for gpu, n in Counter((r.node_ip, r.gpu_id) for r in ordered).items() if n > 1]
    if twice:
        raise PlacementError(
            f"two bundles report the same GPU (node IP, GPU id) {twice[0]}: the cluster's GPU ids are not unique per node"
        )
    return dataclasses.replace(
        plan,
        slot_bundle=tuple(r.bundle for r in ordered),
        slot_gpu=tuple(r.gpu_id for r in ordered),
        slot_node_ip=tuple(r.node_ip for r in ordered),
    )


def resolve(
    plan: PlacementPlan, reports: list[ProbeReport], precision: PrecisionConfig
) -> tuple[PlacementPlan, WorkerResolution]:
    """Resolve the precision on every GPU from its own capability, require agreement, and merge the
    agreed recipe's env vars into the plan (`plan` bound, `reports` the probe's)."""
    from skyq.quant.strategies import get_strategy

    by_bundle = {r.bundle: r for r in reports}
    resolutions = []
    for slot, bundle in enumerate(plan.slot_bundle):
        r = by_bundle[bundle]
        try:
            resolutions.append(resolve_worker(precision, r.capability))
        except ResolutionError as exc:
            raise ResolutionError(
                f"slot {slot} (node {r.node_ip} {r.hostname}, GPU {r.gpu_id}): {exc}"
            ) from None
    agreed = agree(resolutions)
    if agreed.fp8_recipe is Fp8Recipe.auto:  # CPU stand-ins: nothing resolved, no env to add
        return plan, agreed
    env = get_strategy(precision).env_vars(agreed.fp8_recipe)
    return plan.with_env(trainer=env["trainer"], engine=env["engine"]), agreed


@contextmanager
def placement(
    plan: PlacementPlan,
    precision: PrecisionConfig,
    *,
    timeout_s: float,
    report: Callable[..., ProbeReport] = device_report,
    report_args: tuple = (),
    window: int | None = None,
) -> Iterator[StartedPlacement]:
    """The two-phase start: reserve, probe, bind, resolve, then yield what the workers spawn from.
    The placement group is removed when the block ends, however it ends (a sweep's next job gets
    its GPUs back). A CPU plan is reserved alike and bound to its bundles' nodes, with nothing to
    probe or resolve (its workers resolve on their CPU)."""
    from ray.util.placement_group import remove_placement_group

    pg = reserve(plan, timeout_s=timeout_s, name=f"skyq-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        if plan.device is Device.cpu:
            yield StartedPlacement(pg, bind_nodes(plan, pg), None, ())
            return
        reports = probe_bundles(
            pg, plan, timeout_s=timeout_s, report=report, report_args=report_args, window=window
        )
        bound, resolution = resolve(bind(plan, reports), reports, precision)
        tp, _, cp, _ = plan.parallel
        align = (
            None
            if resolution.fp8_recipe is Fp8Recipe.auto
            else packing_alignment(precision, resolution, tp=tp, cp=cp)
        )
        yield StartedPlacement(pg, bound, resolution, tuple(reports), align)
    finally:
        remove_placement_group(pg)


def bind_nodes(plan: PlacementPlan, pg: Any) -> PlacementPlan:
    """A CPU plan with each slot's node IP, from where Ray placed its bundle (slot s is bundle s)."""
    import dataclasses

    import ray

    ips = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
    nodes = ray.util.placement_group_table(pg)["bundles_to_node_id"]
    return dataclasses.replace(plan, slot_node_ip=tuple(ips[nodes[b]] for b in plan.slot_bundle))


def check_intact(started: StartedPlacement) -> None:
    """Raise PlacementError if a node holding part of the placement group is gone (Ray then marks
    the group RESCHEDULING and its bundles there unplaced), naming the node(s) and the trainer
    ranks and engines that were on it. Call it when a worker call fails or times out: an actor on a
    lost node fails at once (ActorDiedError), its peers wait in a collective until the sync
    deadline; either way the run stops, and `resume=<run dir>` continues from the last checkpoint
    once the cluster has the GPUs again."""
    if started.placement_group is None:
        return
    import ray

    table = ray.util.placement_group_table(started.placement_group)
    alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    lost = sorted(b for b, node in table["bundles_to_node_id"].items() if node not in alive)
    if table["state"] == "CREATED" and not lost:
        return
    plan = started.plan
    slots = sorted(plan.slot_bundle.index(b) for b in lost)
    nodes = sorted({plan.slot_node_ip[s] for s in slots})
    ranks = [r.rank for r in plan.trainer if r.slot in slots]
    engines = [e.index for e in plan.engines if set(e.slots) & set(slots)]
    raise PlacementError(
        f"the placement group is {table['state']}: node(s) {', '.join(nodes)} lost with slots {_ranges(slots)} "
        f"(trainer ranks {_ranges(ranks) or 'none'}, engines {_ranges(engines) or 'none'}). The run stops; "
        "resume=<run dir> continues from its last checkpoint once the cluster has those GPUs again."
    )


def _ranges(values: list[int]) -> str:
    """1,2,3,7 -> '1-3, 7'."""
    spans: list[list[int]] = []
    for v in values:
        if spans and v == spans[-1][1] + 1:
            spans[-1][1] = v
        else:
            spans.append([v, v])
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in spans)


def _shape(plan: PlacementPlan) -> str:
    if plan.device is Device.cpu:
        return f"{len(plan.trainer)} trainer rank(s) and {len(plan.engines)} engine(s) on the CPU"
    return f"{plan.num_nodes} node(s) x {plan.gpus_per_node} GPUs"


def _sum(bundles: list[dict[str, float]]) -> dict[str, float]:
    total: Counter[str] = Counter()
    for b in bundles:
        total.update(b)
    return dict(total)


def _counts(resources: dict[str, float]) -> str:
    keys = [k for k in ("GPU", "CPU") if k in resources]
    return " ".join(f"{resources[k]:g} {k}" for k in keys) or "no GPU or CPU"
