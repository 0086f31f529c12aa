"""`simulate=true`: the placement plan run on a logical Ray cluster with stand-in workers, on a CPU.

The cluster is one local Ray node started with `num_gpus` = the topology's GPUs as a *logical*
resource (Ray hands out GPU ids 0..N-1 without a device behind them). The nodes are simulated: a
logical GPU id g is GPU g % gpus_per_node of fake node g // gpus_per_node, whose IP is a scrambled
10.x address, so sorting by (node IP, GPU id) is not the order Ray made the bundles in and the
probe's re-sort is exercised. Everything else is the real code path: `probe.placement` reserves the
plan's placement group, probes every bundle (a stand-in reporting the fake node, GPU and a given
capability), binds and resolves; then stand-ins are started with `plan.actor_options` exactly as
the backends start their workers and report what they got: their GPU id, CUDA_VISIBLE_DEVICES and
environment. A vLLM engine of several GPUs has a stand-in that does what vLLM's Ray executor does
with its env: one worker per VLLM_RAY_BUNDLE_INDICES bundle with VLLM_RAY_PER_WORKER_GPUS and NOSET,
CUDA_VISIBLE_DEVICES = the engine's GPUs on the node, sorted; a one-GPU vLLM engine computes in its
actor (`PlacementPlan.vllm_ray_workers`), so its stand-in is a plain worker holding its GPU. `check` then requires every GPU used once per role, engines
inside nodes (or whole nodes), disjoint sync ranks and every worker's env equal to the plan.

Limits: one raylet, so PACK's spreading over real nodes, node loss and cross-node NCCL are not
exercised; the stand-ins are Ray tasks (the real workers are actors with the same options: same
bundle, GPU fraction and runtime_env); nothing touches CUDA.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from skyq.config.resolve import Capability, WorkerResolution, resolve_worker
from skyq.config.schema import PrecisionConfig, TrainConfig
from skyq.launch.plan import (
    CPUS_PER_BUNDLE,
    ENGINE,
    ENGINE_WORKER,
    NOSET_VISIBLE_DEVICES,
    PLAN_OWNED_ENV,
    TRAINER,
    PlacementPlan,
    plan_placement,
)
from skyq.launch.probe import ProbeReport, gather, placement

GENERATIONS: tuple[tuple[int, int], ...] = ((9, 0), (10, 0))
"""The GPU generations a simulated probe may report (Hopper, Blackwell)."""


WINDOW = 8
"""Stand-in tasks in flight at once: on one machine Ray starts a worker process for each pending
task it can place (seconds of CPU each), while a few reused workers answer them all as well."""


class SimulationError(RuntimeError):
    """A stand-in got something other than the plan gave it; the message lists every difference."""


def fake_node_ip(node: int) -> str:
    """Simulated node `node`'s IP: a permutation of 10.0.x.1, not in node order."""
    return f"10.0.{(node * 37 + 11) % 256}.1"


def simulated_capability(precision: PrecisionConfig) -> tuple[int, int]:
    """The first generation of `GENERATIONS` the precision resolves on (what the dry run would
    print as not refused): the simulated GPUs' capability unless a test gives others."""
    from skyq.quant.strategies import get_strategy

    for capability in GENERATIONS:
        try:
            get_strategy(precision).env_vars(resolve_worker(precision, capability).fp8_recipe)
        except ValueError:
            continue
        return capability
    raise ValueError(
        f"simulate=true: precision={precision.name.value} resolves on none of SM90 / SM100 (dry_run=true says why)"
    )


def sim_report(
    bundle: int, gpus_per_node: int, capability: Capability, per_node: dict[int, Capability]
) -> ProbeReport:
    """The stand-in probe: the fake node and GPU of the logical GPU Ray gave this task, and
    `capability` (or the node's own in `per_node`)."""
    import ray

    gid = int(ray.get_gpu_ids()[0])
    node = gid // gpus_per_node
    return ProbeReport(
        bundle=bundle,
        node_ip=fake_node_ip(node),
        hostname=f"sim-node-{node}",
        gpu_id=gid % gpus_per_node,
        capability=per_node.get(node, capability),
    )


def _seen(gpus_per_node: int, keys: list[str]) -> dict[str, Any]:
    """What a stand-in process got: its logical GPU (as fake node IP, GPU id), what Ray set as
    CUDA_VISIBLE_DEVICES, and the environment variables in `keys` and the plan-owned ones."""
    import ray

    gids = [int(g) for g in ray.get_gpu_ids()]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return {
        "where": [(fake_node_ip(g // gpus_per_node), g % gpus_per_node) for g in gids],
        "ray_visible": None
        if visible is None
        else ",".join(str(int(v) % gpus_per_node) for v in visible.split(",") if v),
        "env": {
            k: os.environ[k] for k in {*keys, *PLAN_OWNED_ENV} - {"CUDA_VISIBLE_DEVICES"} if k in os.environ
        },
    }


def stand_in_worker(gpus_per_node: int, keys: list[str]) -> dict[str, Any]:
    return _seen(gpus_per_node, keys)


def stand_in_vllm_engine(
    gpus_per_node: int, keys: list[str], worker_keys: list[str], timeout_s: float
) -> dict[str, Any]:
    """What vLLM's Ray executor does from the engine actor's env (vllm/v1/executor/ray_executor.py):
    a worker per VLLM_RAY_BUNDLE_INDICES bundle of the current placement group, VLLM_RAY_PER_WORKER_GPUS
    each, NOSET so Ray leaves CUDA_VISIBLE_DEVICES alone, then per node the sorted GPU ids."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from skyq.launch.probe import gather

    pg = ray.util.get_current_placement_group()
    worker = ray.remote(stand_in_worker)

    def call(bundle: int) -> Any:
        strategy = PlacementGroupSchedulingStrategy(
            placement_group=pg, placement_group_capture_child_tasks=True, placement_group_bundle_index=bundle
        )
        options = {"num_cpus": 0, "num_gpus": float(os.environ["VLLM_RAY_PER_WORKER_GPUS"])}
        env = {"env_vars": {NOSET_VISIBLE_DEVICES: "1"}}
        return lambda: worker.options(**options, scheduling_strategy=strategy, runtime_env=env).remote(
            gpus_per_node, worker_keys
        )

    bundles = [int(b) for b in os.environ["VLLM_RAY_BUNDLE_INDICES"].split(",")]
    # vLLM starts them all at once; a window of 2 keeps this machine to two worker processes per engine.
    workers = gather([call(b) for b in bundles], timeout_s=timeout_s, window=2)
    per_node: dict[str, list[int]] = {}
    for w in workers:
        ip, gpu = w["where"][0]
        per_node.setdefault(ip, []).append(gpu)
    for w in workers:
        w["vllm_visible"] = ",".join(str(g) for g in sorted(per_node[w["where"][0][0]]))
    return {**_seen(gpus_per_node, keys), "workers": workers}


@dataclass(frozen=True, slots=True)
class SimulationResult:
    plan: PlacementPlan
    """Bound and resolved, as the workers got it."""
    reports: tuple[ProbeReport, ...]
    trainer: list[dict[str, Any]]
    engines: dict[int, dict[str, Any]]
    """What each engine stand-in saw, by engine index (those simulated)."""
    moved: int
    """Slots whose bundle is not the bundle of the same index (the re-sort at work)."""
    seconds: float
    resolution: WorkerResolution | None = None
    packing_alignment: int | None = None


def run_stand_ins(
    started: Any, engines: Sequence[int] | None = None, *, timeout_s: float = 600
) -> tuple[list[dict[str, Any]], dict[int, dict[str, Any]]]:
    """Start every trainer rank and the engines `engines` (None: all) as stand-ins with the plan's
    options; their reports (engines by index)."""
    import ray

    plan: PlacementPlan = started.plan
    chosen = [plan.engines[i] for i in (range(len(plan.engines)) if engines is None else engines)]
    gpn = plan.gpus_per_node
    worker = ray.remote(stand_in_worker)
    trainer = [
        lambda r=r: worker.options(**started.actor_options(TRAINER, r.rank)).remote(
            gpn, list(plan.env(TRAINER, r.rank))
        )
        for r in plan.trainer
    ]
    if plan.vllm_ray_workers:
        engine = ray.remote(stand_in_vllm_engine)
        engine_calls = [
            lambda e=e: engine.options(**started.actor_options(ENGINE, e.index)).remote(
                gpn,
                list(plan.env(ENGINE, e.index)),
                list(plan.env(ENGINE_WORKER, e.index * plan.gpus_per_engine)),
                timeout_s,
            )
            for e in chosen
        ]
    else:
        engine_calls = [
            lambda e=e: worker.options(**started.actor_options(ENGINE, e.index)).remote(
                gpn, list(plan.env(ENGINE, e.index))
            )
            for e in chosen
        ]
    trainer_reports = gather(trainer, timeout_s=timeout_s, window=WINDOW)
    # Each engine has an env of its own (its bundles): a Ray worker process each, two at a time.
    engine_reports = gather(engine_calls, timeout_s=timeout_s, window=2)
    return trainer_reports, {e.index: seen for e, seen in zip(chosen, engine_reports)}


def check(plan: PlacementPlan, trainer: list[dict[str, Any]], engines: dict[int, dict[str, Any]]) -> None:
    """Raise SimulationError listing every way the stand-ins' reports differ from the plan (the
    engines checked are those in `engines`; the sync ranks of all)."""
    problems: list[str] = []
    where = {slot: (plan.slot_node_ip[slot], plan.slot_gpu[slot]) for slot in range(plan.num_slots)}

    def expect(
        label: str,
        seen: dict[str, Any],
        slot: int,
        env: dict[str, str],
        visible: str | None,
        got_visible: str | None,
    ) -> None:
        if seen["where"] != [where[slot]]:
            problems.append(f"{label}: on {seen['where']}, the plan says slot {slot} = {where[slot]}")
        if seen["env"] != {k: v for k, v in env.items() if k != "CUDA_VISIBLE_DEVICES"}:
            problems.append(f"{label}: env {seen['env']} != the plan's {env}")
        if got_visible != visible:
            problems.append(f"{label}: CUDA_VISIBLE_DEVICES {got_visible!r}, the plan says {visible!r}")

    landed = {v: k for k, v in where.items()}
    for r, seen in zip(plan.trainer, trainer):
        expect(
            f"trainer rank {r.rank}",
            seen,
            r.slot,
            plan.env(TRAINER, r.rank),
            plan.visible_devices(TRAINER, r.rank),
            seen["ray_visible"],
        )
    worker_slots: list[int] = []
    for index, seen in engines.items():
        e = plan.engines[index]
        if not plan.vllm_ray_workers:
            expect(
                f"engine {e.index}",
                seen,
                e.slots[0],
                plan.env(ENGINE, e.index),
                plan.visible_devices(ENGINE, e.index),
                seen["ray_visible"],
            )
            worker_slots.append(landed.get(tuple(seen["where"][0]), -1) if seen["where"] else -1)
            continue
        if seen["where"] or seen["ray_visible"] is not None:
            problems.append(
                f"engine {e.index}: the engine actor holds GPU {seen['where']} / CUDA_VISIBLE_DEVICES {seen['ray_visible']!r}, the plan gives it none"
            )
        if seen["env"] != plan.env(ENGINE, e.index):
            problems.append(f"engine {e.index}: env {seen['env']} != the plan's {plan.env(ENGINE, e.index)}")
        for w, (slot, got) in enumerate(zip(e.slots, seen["workers"])):
            flat = e.index * plan.gpus_per_engine + w
            if got["ray_visible"] is not None:
                problems.append(
                    f"engine {e.index} worker {w}: Ray set CUDA_VISIBLE_DEVICES={got['ray_visible']} despite NOSET"
                )
            expect(
                f"engine {e.index} worker {w}",
                got,
                slot,
                plan.env(ENGINE_WORKER, flat),
                plan.visible_devices(ENGINE_WORKER, flat),
                got["vllm_visible"],
            )
        worker_slots += [landed.get(tuple(got["where"][0]), -1) for got in seen["workers"]]
        nodes = {got["where"][0][0] for got in seen["workers"]}
        if len(nodes) != -(-plan.gpus_per_engine // plan.gpus_per_node):
            problems.append(f"engine {e.index}: workers on {len(nodes)} node(s) {sorted(nodes)}")
    trainer_slots = [landed.get(tuple(seen["where"][0]), -1) if seen["where"] else -1 for seen in trainer]
    for role, slots in (("trainer", trainer_slots), ("engine", worker_slots)):
        twice = [s for s, n in Counter(slots).items() if n > 1]
        if twice:
            problems.append(f"{role}: slots {twice[:8]} used more than once")
    ranges = sorted(
        (e.global_sync_rank_offset, e.global_sync_rank_offset + len(e.slots)) for e in plan.engines
    )
    if any(a[1] > b[0] for a, b in zip(ranges, ranges[1:])) or (ranges and ranges[0][0] < 1):
        problems.append(f"sync rank ranges overlap (or take the sender's rank 0): {ranges[:8]}")
    for e in plan.engines:
        if e.sync_rank_offset < 1 or e.sync_rank_offset + len(e.slots) != e.sync_world_size:
            problems.append(
                f"engine {e.index}: sync ranks {e.sync_rank_offset}..{e.sync_world_size - 1} do not follow the sender"
            )
    if problems:
        raise SimulationError(f"{len(problems)} difference(s) from the plan: " + "; ".join(problems[:12]))


def simulate(
    cfg: TrainConfig,
    *,
    capabilities: dict[int, Capability] | None = None,
    engines: Sequence[int] | None = None,
) -> SimulationResult:
    """Plan, reserve, probe, bind, resolve and start the stand-ins on the running logical cluster;
    check. `capabilities`: per simulated node, what its probes report (default `simulated_capability`); `engines`:
    which engines get stand-ins (None: all; each engine is a Ray worker process of its own, the
    costly part on a small machine)."""
    plan = plan_placement(topology=cfg.topology, rollout=cfg.rollout, trainer=cfg.trainer)
    if not plan.num_slots:
        raise ValueError(
            f"simulate=true: topology={cfg.topology.name} has no GPUs, so there is no placement group to simulate "
            "(dry_run=true prints its placement)"
        )
    start = time.perf_counter()
    args = (plan.gpus_per_node, simulated_capability(cfg.precision), capabilities or {})
    with placement(
        plan,
        cfg.precision,
        timeout_s=cfg.topology.placement_timeout_s,
        report=sim_report,
        report_args=args,
        window=WINDOW,
    ) as started:
        trainer, seen = run_stand_ins(started, engines, timeout_s=cfg.topology.placement_timeout_s)
        check(started.plan, trainer, seen)
        moved = sum(b != s for s, b in enumerate(started.plan.slot_bundle))
        return SimulationResult(
            started.plan, started.reports, trainer, seen, moved, time.perf_counter() - start,
            started.resolution, started.packing_alignment,
        )  # fmt: skip


@contextmanager
def logical_cluster(num_gpus: int) -> Iterator[None]:
    """A loopback local Ray with `num_gpus` logical GPUs (and a CPU per bundle); a running Ray with
    enough GPUs and CPUs is used as is (a test module's, a sweep's), one without is refused."""
    import ray

    from skyq.launch.ray_local import LOOPBACK, _loopback_node, startup_line

    cpus = num_gpus * CPUS_PER_BUNDLE + 2
    if ray.is_initialized():
        have = ray.cluster_resources()
        if have.get("GPU", 0) < num_gpus or have.get("CPU", 0) < num_gpus * CPUS_PER_BUNDLE:
            raise RuntimeError(
                f"simulate=true needs a Ray cluster of {num_gpus} logical GPUs; the running one has "
                f"{have.get('GPU', 0):g} GPU {have.get('CPU', 0):g} CPU"
            )
        yield
        return
    start = time.perf_counter()
    with _loopback_node():
        ray.init(
            num_cpus=cpus, num_gpus=num_gpus, include_dashboard=False, log_to_driver=False,
            namespace="skyq-simulate", _node_ip_address=LOOPBACK,
        )  # fmt: skip
    startup_line(f"logical Ray cluster of {num_gpus} GPUs up in {time.perf_counter() - start:.1f} s")
    try:
        yield
    finally:
        ray.shutdown()


def render(result: SimulationResult, cfg: TrainConfig) -> str:
    """The simulation's text: the plan (as the dry run prints it), then what the stand-ins showed."""
    from skyq.launch.placement import describe_plan

    plan = result.plan
    caps = Counter(r.capability for r in result.reports)
    gpus = ", ".join(f"{n} x SM{c[0]}{c[1]}" if c else f"{n} x CPU" for c, n in caps.items())
    res = f"; precision resolved on every GPU ({gpus}) and agreed"
    if result.resolution is not None:
        r = result.resolution
        res += f": recipe {r.fp8_recipe.value}, scales {r.scale_format.value}, packing alignment {result.packing_alignment} tokens"
    workers = sum(len(e.get("workers", [e])) for e in result.engines.values())
    return "\n".join(
        [
            f"skyq simulation: topology={cfg.topology.name} trainer={cfg.trainer.backend.value} "
            f"rollout={cfg.rollout.backend.value} on a logical Ray cluster ({plan.num_nodes} simulated node(s) x "
            f"{plan.gpus_per_node} GPUs, stand-in workers, no device)",
            "",
            describe_plan(plan_placement(topology=cfg.topology, rollout=cfg.rollout, trainer=cfg.trainer)),
            "",
            f"probe: {len(result.reports)} bundles re-sorted by (node IP, GPU id), {result.moved} slot(s) on another "
            f"bundle index than their own{res}",
            f"stand-ins: {len(result.trainer)} trainer rank(s), {len(result.engines)} of {len(plan.engines)} engine(s), {workers} engine "
            f"worker(s) placed and checked in {result.seconds:.1f} s: every GPU once per role, engines within their "
            "node(s), sync ranks disjoint, every worker's bundle, CUDA_VISIBLE_DEVICES and env as planned",
        ]
    )


def run_simulation(cfg: TrainConfig) -> str:
    """`simulate=true`: the whole simulation on a logical cluster of the topology's GPUs (or the
    running one, in a sweep); its text."""
    with logical_cluster(cfg.topology.num_nodes * cfg.topology.gpus_per_node):
        return render(simulate(cfg), cfg)
