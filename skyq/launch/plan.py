"""The placement plan: which GPU of which node every trainer rank and every engine worker gets.

Pure (no Ray, no device): computed on the driver from the topology and the backends, printed by the
dry run and by the simulation (`python -m skyq.simulate`), and consumed by the backends through
`PlacementPlan.actor_options`.

The model is slime's: one placement group, PACK, one bundle `{"GPU": 1, "CPU": CPUS_PER_BUNDLE}` per
GPU of the topology. A *slot* is a position in node-major order (slot = node * gpus_per_node + gpu);
the plan is written in slots. At start the probe (`skyq.launch.probe`) learns which node and GPU each
bundle of the real placement group landed on, sorts the bundles by (node IP, GPU id) and binds slot
s to the s-th bundle of that order, so ranks follow the hardware whatever order Ray gave the bundles.

Layouts. Colocated: the trainer and the engines share every slot (trainer rank r on slot r with
`TRAINER_COLOCATED_GPUS` of its GPU, each engine worker with `ENGINE_WORKER_COLOCATED_GPUS`). Split:
the trainer takes slots [0, trainer_gpus), the engines the slots after it, whole GPUs each.

Trainer ranks: world = tp * pp * cp * dp (dp None: trainer_gpus / (tp * pp * cp)), Megatron's default
rank order (tp fastest, then cp, dp, pp), so a TP group fills consecutive GPUs of one node.

Engines: `rollout.num_engines`, else rollout GPUs / `rollout.gpus_per_engine`. Engine i takes
gpus_per_engine consecutive slots and never straddles a node: engines are packed node by node and a
node's rollout GPUs that cannot hold a whole engine are refused. An engine wider than a node
(gpus_per_engine > gpus_per_node) must be a whole number of nodes starting on a node boundary; it
is one engine whose workers are grouped per node (`EngineSpec.node_groups`: vLLM's Ray executor
starts gpus_per_node workers per node and ranks them node by node; a backend that starts one
process per node, as slime does for SGLang, takes one group each).

CPU (`topology.device=cpu`). The same one placement group, with a bundle per worker instead of per
GPU: the trainer ranks' bundles share `CPU_TRAINER_CPUS` logical CPUs and the engines' share
`CPU_ENGINE_CPUS`, so any world and any number of engines fit the local cluster's two CPUs. Slot
r is trainer rank r, slot world + i engine i; nothing is probed (no GPU to find), the bundles'
nodes are read from Ray's placement-group table.

Which backend runs how many ranks: trainer=megatron one per rank of tp * pp * cp * dp (on the CPU
dp null means 1); trainer=torch one process, rank 0 on slot 0, whatever the topology's trainer GPUs.

Devices. A trainer rank is a Ray actor with a GPU fraction: Ray sets its CUDA_VISIBLE_DEVICES to the
bundle's GPU (device 0 inside the process). A vLLM engine of several GPUs is an actor with no GPU of
its own on the bundle of its first slot (`placement_group_capture_child_tasks`, so vLLM's workers land
in the same group); it gets VLLM_RAY_BUNDLE_INDICES (its bundles, after the re-sort) and
VLLM_RAY_PER_WORKER_GPUS and vLLM's Ray executor (vLLM's default for a world above 1 inside a placement
group) starts one worker per bundle with RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES, then sets each
worker's CUDA_VISIBLE_DEVICES to the engine's GPUs on that node (sorted) and picks its device by local
rank (vllm/v1/executor/ray_executor.py, 0.26-0.33). The engine actor itself gets the NOSET variable
too, so Ray leaves its CUDA_VISIBLE_DEVICES alone for vLLM. A one-GPU vLLM engine (gpus_per_engine 1,
so TP1 and DP1) is vLLM world 1, which vLLM runs in the calling process (its `uni` executor, on device 0;
vllm/config/parallel.py, 0.26 and 0.32) and starts no Ray worker: its actor holds its GPU share itself,
without NOSET, so Ray sets CUDA_VISIBLE_DEVICES to its GPU and device 0 is that GPU (with NOSET it
would see the whole node and take GPU 0). An embedded engine is one GPU actor the same way.

Weight sync: one NCCL group per engine, world 1 + gpus_per_engine: trainer rank 0 sends as group
rank 0, engine worker w receives as group rank 1 + w (rank offset 1). `global_sync_rank_offset` is
the same engine's offset in a single group over all engines (1 + i * gpus_per_engine), for a
transport that builds one group.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from skyq.config.enums import Device, Placement, RolloutBackend, TrainerBackend
from skyq.config.schema import RolloutConfig, TopologyConfig, TrainerConfig
from skyq.launch.redaction import split_worker_env

CPUS_PER_BUNDLE = 1
"""Logical CPUs in each GPU bundle: the trainer rank's (engine actors and vLLM's workers take none)."""
TRAINER_COLOCATED_GPUS = 0.4
"""A trainer rank's share of its GPU when the engines share it (slime's figure)."""
ENGINE_WORKER_COLOCATED_GPUS = 0.2
"""An engine worker's share of its GPU when the trainer shares it (vLLM's VLLM_RAY_PER_WORKER_GPUS)."""
CPU_TRAINER_CPUS = 1.0
"""Logical CPUs of a CPU plan's trainer bundles together (1/world each)."""
CPU_ENGINE_CPUS = 1.0
"""Logical CPUs of a CPU plan's engine bundles together (1/num_engines each)."""
PROBE_GPUS = 0.1
"""The start-up probe's share of a bundle's GPU (enough for Ray to hand it the GPU's id)."""
NOSET_VISIBLE_DEVICES = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"
PLAN_OWNED_ENV = frozenset({NOSET_VISIBLE_DEVICES, "VLLM_RAY_BUNDLE_INDICES", "VLLM_RAY_PER_WORKER_GPUS", "CUDA_VISIBLE_DEVICES"})  # fmt: skip
"""Variables the plan sets (or Ray/vLLM set from it); a `trainer.env` / `rollout.env` entry for one is refused."""
TRAINER, ENGINE, ENGINE_WORKER = "trainer", "engine", "engine_worker"
ROLES = (TRAINER, ENGINE, ENGINE_WORKER)


class PlanError(ValueError):
    """The topology and the backends admit no placement; the message names the keys and the fix."""


@dataclass(frozen=True, slots=True)
class TrainerRank:
    rank: int
    slot: int
    tp: int
    """Coordinates in the (tp, cp, dp, pp) grid."""
    cp: int
    dp: int
    pp: int


@dataclass(frozen=True, slots=True)
class EngineSpec:
    index: int
    slots: tuple[int, ...]
    """The engine's GPUs, worker w on slots[w]."""
    node_groups: tuple[tuple[int, ...], ...]
    """Worker indices per node the engine spans (one group unless gpus_per_engine > gpus_per_node)."""
    sync_world_size: int
    """Its weight-sync group: trainer rank 0 (the sender) + one rank per worker."""
    sync_rank_offset: int
    """Group rank of worker 0 (worker w is sync_rank_offset + w)."""
    global_sync_rank_offset: int
    """Worker 0's rank in one group over all engines (1 + index * gpus_per_engine)."""


@dataclass(frozen=True, slots=True)
class WorkerSlot:
    """Everything about one worker in one place (`PlacementPlan.worker`)."""

    role: str
    index: int
    slot: int | None
    """None on a CPU plan."""
    bundle: int | None
    """Placement-group bundle index (after the probe's re-sort)."""
    node: int
    node_ip: str | None
    """None until the plan is bound."""
    gpu: int | None
    """GPU id on its node."""
    num_gpus: float
    visible_devices: str | None
    env: dict[str, str]
    sync_world_size: int | None
    """The weight-sync group this worker is in (trainer rank 0: every engine's; None: none)."""
    sync_rank: int | None


@dataclass(frozen=True, slots=True)
class PlacementPlan:
    device: Device
    num_nodes: int
    gpus_per_node: int
    layout: Placement
    rollout_backend: RolloutBackend
    trainer: tuple[TrainerRank, ...]
    engines: tuple[EngineSpec, ...]
    parallel: tuple[int, int, int, int]
    """(tp, pp, cp, dp) of the trainer."""
    expert_parallel: tuple[int, int] = (1, 1)
    """(ep, etp) of the trainer: how its ranks share the experts (printed; placement follows tp/cp/dp/pp)."""
    trainer_env: dict[str, str] = field(default_factory=dict)
    """trainer.env (the user's: its secret names travel by file, `secret_env`)."""
    engine_env: dict[str, str] = field(default_factory=dict)
    """rollout.env."""
    resolved_env: dict[str, dict[str, str]] = field(default_factory=dict)
    """The precision's variables for the recipe the workers resolved, per side (`with_env`); not secret."""
    slot_bundle: tuple[int, ...] = ()
    """Placement-group bundle index of each slot (identity until the probe binds the plan)."""
    slot_gpu: tuple[int, ...] = ()
    """GPU id on its node of each slot (slot % gpus_per_node until bound)."""
    slot_node_ip: tuple[str, ...] = ()
    """Node IP of each slot, once bound (empty before)."""

    # ---- shape ---------------------------------------------------------------------------------
    @property
    def num_slots(self) -> int:
        return len(self.slot_bundle)

    @property
    def bundles(self) -> list[dict[str, float]]:
        """The placement group's bundles (`ray.util.placement_group(plan.bundles, strategy="PACK")`)."""
        if self.device is Device.cpu:
            return [{"CPU": self.slot_cpus(s)} for s in range(self.num_slots)]
        return [{"GPU": 1, "CPU": CPUS_PER_BUNDLE} for _ in range(self.num_slots)]

    def slot_cpus(self, slot: int) -> float:
        """Logical CPUs of a CPU plan's slot: its share of the trainer's or of the engines' CPUs
        (rounded to Ray's resource precision, so the actor asks exactly what its bundle holds)."""
        if slot < len(self.trainer):
            return round(CPU_TRAINER_CPUS / len(self.trainer), 4)
        return round(CPU_ENGINE_CPUS / len(self.engines), 4)

    @property
    def gpus_per_engine(self) -> int:
        return len(self.engines[0].slots) if self.engines and self.num_slots else 0

    def node(self, slot: int) -> int:
        """The node index of `slot` (a CPU plan: the node of its bundle in IP order, once bound)."""
        if self.device is Device.cpu:
            ips = sorted(set(self.slot_node_ip), key=_ip_key)
            return ips.index(self.slot_node_ip[slot]) if self.slot_node_ip else 0
        return slot // self.gpus_per_node

    # ---- per worker ----------------------------------------------------------------------------
    def num_gpus(self, role: str) -> float:
        """The Ray GPU request of one `role` actor."""
        if self.device is Device.cpu or (role == ENGINE and self.vllm_ray_workers):
            return 0
        if self.layout is Placement.split:
            return 1
        return TRAINER_COLOCATED_GPUS if role == TRAINER else ENGINE_WORKER_COLOCATED_GPUS

    def env(self, role: str, index: int) -> dict[str, str]:
        """Every variable the `role` process `index` starts with, set at spawn (TE and vLLM read them
        at import). `engine_worker` indexes are flat: engine * gpus_per_engine + worker."""
        if role == TRAINER:
            return {**self.resolved_env.get("trainer", {}), **self.trainer_env}
        if role == ENGINE_WORKER:
            if not self.vllm_ray_workers:  # a one-GPU engine is its own (only) worker
                return self.env(ENGINE, index)
            # vLLM's workers are Ray actors started from the engine actor: Ray merges the engine's
            # env_vars into theirs, and the executor adds NOSET (already in the engine's).
            return self.env(ENGINE, index // self.gpus_per_engine)
        env = {**self.resolved_env.get("engine", {}), **self.engine_env}
        if self.vllm_ray_workers:
            slots = self.engines[index].slots
            env[NOSET_VISIBLE_DEVICES] = "1"
            env["VLLM_RAY_BUNDLE_INDICES"] = ",".join(str(self.slot_bundle[s]) for s in slots)
            env["VLLM_RAY_PER_WORKER_GPUS"] = f"{self.num_gpus(ENGINE_WORKER):g}"
        return env

    def visible_devices(self, role: str, index: int) -> str | None:
        """CUDA_VISIBLE_DEVICES the process will see (None: not set by Ray/vLLM). A trainer rank or an
        one-GPU engine: its GPU (device 0). A worker of a wider vLLM engine: the engine's GPUs on its
        node, sorted (its actor: None)."""
        if self.device is Device.cpu or (role == ENGINE and self.vllm_ray_workers):
            return None
        if role == TRAINER:
            return str(self.slot_gpu[self.trainer[index].slot])
        if role == ENGINE:
            return str(self.slot_gpu[self.engines[index].slots[0]])
        engine, worker = divmod(index, self.gpus_per_engine)
        slot = self.engines[engine].slots[worker]
        same_node = [s for s in self.engines[engine].slots if self.node(s) == self.node(slot)]
        return ",".join(str(g) for g in sorted(self.slot_gpu[s] for s in same_node))

    def slot_of(self, role: str, index: int) -> int:
        if role == TRAINER:
            return self.trainer[index].slot
        if role == ENGINE:
            return self.engines[index].slots[0]
        engine, worker = divmod(index, self.gpus_per_engine)
        return self.engines[engine].slots[worker]

    def worker(self, role: str, index: int) -> WorkerSlot:
        """Where `role` worker `index` runs and what it starts with (flat `engine_worker` index)."""
        slot = self.slot_of(role, index)
        sync: tuple[int | None, int | None] = (None, None)
        if role == TRAINER and index == 0 and self.engines:
            sync = (self.engines[0].sync_world_size, 0)  # the sender of every engine's group
        elif role == ENGINE_WORKER or (role == ENGINE and not self.vllm_ray_workers):
            engine, worker = divmod(index, max(self.gpus_per_engine, 1))
            e = self.engines[engine]
            sync = (e.sync_world_size, e.sync_rank_offset + worker)
        return WorkerSlot(
            role=role,
            index=index,
            slot=slot,
            bundle=self.slot_bundle[slot],
            node=self.node(slot),
            node_ip=self.slot_node_ip[slot] if self.slot_node_ip else None,
            gpu=None if self.device is Device.cpu else self.slot_gpu[slot],
            num_gpus=self.num_gpus(role),
            visible_devices=self.visible_devices(role, index),
            env=self.env(role, index),
            sync_world_size=sync[0],
            sync_rank=sync[1],
        )

    def actor_options(self, role: str, index: int, placement_group: Any = None) -> dict[str, Any]:
        """Ray `.options(...)` of the `role` actor `index` on `placement_group` (the plan's, ready):
        its bundle, GPU fraction, CPUs and the public part of its env (`secret_env` goes through
        `skyq.launch.worker_env`'s file, never through Ray's logged runtime_env)."""
        if role not in ROLES:
            raise ValueError(f"role {role!r}: one of {ROLES}")
        if placement_group is None:
            raise ValueError("the plan's actors need the plan's placement group (probe.placement)")
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        secret = self.secret_env(role, index)
        public = {k: v for k, v in self.env(role, index).items() if k not in secret}
        slot = self.slot_of(role, index)
        if self.device is Device.cpu:
            cpus: float = self.slot_cpus(slot)
        else:
            cpus = CPUS_PER_BUNDLE if role == TRAINER else 0
        options: dict[str, Any] = {
            "num_cpus": cpus,
            "num_gpus": self.num_gpus(role),
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                placement_group=placement_group,
                placement_group_bundle_index=self.slot_bundle[slot],
                placement_group_capture_child_tasks=role == ENGINE,
            ),
        }
        if public:
            options["runtime_env"] = {"env_vars": public}
        return options

    def secret_env(self, role: str, index: int) -> dict[str, str]:
        """The user's variables that are not allow-listed library settings: `actor_options` leaves
        them out of Ray's (logged) runtime_env; they go through `skyq.launch.worker_env`'s file.
        The plan's own and the resolution's variables are never secret."""
        user = self.trainer_env if role == TRAINER else self.engine_env
        return split_worker_env(dict(user))[1]

    def with_env(self, *, trainer: dict[str, str], engine: dict[str, str]) -> PlacementPlan:
        """The plan with the resolution's env (under the user's: `trainer.env` / `rollout.env` win)."""
        return dataclasses.replace(self, resolved_env={"trainer": dict(trainer), "engine": dict(engine)})

    @property
    def vllm_ray_workers(self) -> bool:
        """Whether vLLM's Ray executor starts the engines' workers on their bundles (vLLM on GPUs, more
        than one GPU per engine); otherwise each engine computes in its own actor on the GPU share the
        plan gives that actor (a one-GPU vLLM engine, the embedded engine, any engine on the CPU)."""
        return (
            self.device is not Device.cpu
            and self.rollout_backend is RolloutBackend.vllm
            and self.gpus_per_engine > 1
        )


def plan_placement(
    *, topology: TopologyConfig, rollout: RolloutConfig, trainer: TrainerConfig
) -> PlacementPlan:
    """The placement plan of `topology` for the trainer and rollout backends (pure; raises PlanError)."""
    p = topology.parallel
    for side, env in (("trainer", trainer.env), ("rollout", rollout.env)):
        owned = sorted(PLAN_OWNED_ENV & set(env))
        if owned:
            raise PlanError(
                f"{side}.env sets {', '.join(owned)}: the placement plan sets these from the placement "
                f"group (docs/placement.md). Fix: drop {side}.env.{owned[0]}."
            )
    common = dict(
        layout=topology.placement,
        rollout_backend=rollout.backend,
        trainer_env=dict(trainer.env),
        engine_env=dict(rollout.env),
    )
    one_process = trainer.backend is TrainerBackend.torch
    tp, pp, cp = (1, 1, 1) if one_process else (p.tp, p.pp, p.cp)
    model = tp * pp * cp
    if topology.device is Device.cpu:
        dp = 1 if one_process or p.dp is None else p.dp
        ranks = _ranks(tp, cp, dp, pp)
        engines = rollout.num_engines or 1
        world = len(ranks)
        return PlacementPlan(
            device=Device.cpu, num_nodes=1, gpus_per_node=0, parallel=(tp, pp, cp, dp),
            expert_parallel=(p.ep, p.etp), trainer=ranks,
            engines=tuple(EngineSpec(i, (world + i,), ((0,),), 2, 1, 1 + i) for i in range(engines)),
            slot_bundle=tuple(range(world + engines)), **common,
        )  # fmt: skip
    gpn, total = topology.gpus_per_node, topology.num_nodes * topology.gpus_per_node
    if gpn < 1:
        raise PlanError(
            f"topology.device={topology.device.value} with topology.gpus_per_node={gpn}: a GPU topology needs "
            "GPUs. Fix: topology.gpus_per_node >= 1, or topology=cpu."
        )
    if one_process:
        dp = 1
    else:
        dp = p.dp if p.dp is not None else topology.trainer_gpus // model
    if not one_process and (model * dp != topology.trainer_gpus or dp < 1):
        raise PlanError(
            f"topology.parallel: tp*pp*cp*dp = {p.tp}*{p.pp}*{p.cp}*{p.dp} does not fill topology.trainer_gpus="
            f"{topology.trainer_gpus}. Fix: topology.parallel.dp=null (derived) or sizes whose product is the trainer GPUs."
        )
    split = topology.placement is Placement.split
    needed = (
        topology.trainer_gpus + topology.rollout_gpus
        if split
        else max(topology.trainer_gpus, topology.rollout_gpus)
    )
    if needed > total:
        raise PlanError(
            f"topology={topology.name}: {topology.placement.value} needs {needed} GPUs (trainer_gpus "
            f"{topology.trainer_gpus}, rollout_gpus {topology.rollout_gpus}), the topology has "
            f"num_nodes*gpus_per_node = {total}. Fix: topology.trainer_gpus / rollout_gpus."
        )
    offset = topology.trainer_gpus if split else 0
    engines = _engines(topology, rollout, offset)
    return PlacementPlan(
        device=Device.cuda, num_nodes=topology.num_nodes, gpus_per_node=gpn, parallel=(tp, pp, cp, dp),
        expert_parallel=(p.ep, p.etp),
        trainer=_ranks(tp, cp, dp, pp), engines=engines, slot_bundle=tuple(range(total)),
        slot_gpu=tuple(s % gpn for s in range(total)), **common,
    )  # fmt: skip


def _ranks(tp: int, cp: int, dp: int, pp: int) -> tuple[TrainerRank, ...]:
    """Megatron's default rank order (tp fastest, then cp, dp, pp), rank r on slot r."""
    ranks = []
    for rank in range(tp * cp * dp * pp):
        tp_r, rest = rank % tp, rank // tp
        cp_r, rest = rest % cp, rest // cp
        ranks.append(TrainerRank(rank=rank, slot=rank, tp=tp_r, cp=cp_r, dp=rest % dp, pp=rest // dp))
    return tuple(ranks)


def _ip_key(ip: str) -> tuple[int, ...]:
    """An IPv4 address sortable as a number (10.0.10.1 after 10.0.9.1)."""
    return tuple(int(part) for part in ip.split(".")) if ip.count(".") == 3 else (0,)


def _engines(topology: TopologyConfig, rollout: RolloutConfig, offset: int) -> tuple[EngineSpec, ...]:
    """Engine slots packed node by node from `offset` over the rollout GPUs, never straddling a node."""
    gpn, gpe = topology.gpus_per_node, rollout.gpus_per_engine
    wanted = rollout.num_engines or topology.rollout_gpus // gpe
    if rollout.backend is RolloutBackend.embedded and gpe != 1:
        raise PlanError(
            f"rollout.gpus_per_engine={gpe}: the embedded engine runs on one GPU. Fix: rollout.gpus_per_engine=1 or rollout=vllm."
        )
    region = range(offset, offset + topology.rollout_gpus)
    starts: list[int] = []
    if gpe > gpn:
        if gpe % gpn or offset % gpn:
            raise PlanError(
                f"rollout.gpus_per_engine={gpe} is wider than a node (topology.gpus_per_node={gpn}): such an "
                f"engine must be whole nodes starting on a node boundary (rollout GPUs start at GPU {offset}). "
                f"Fix: rollout.gpus_per_engine a multiple of {gpn}, trainer_gpus a multiple of {gpn}."
            )
        starts = list(range(region.start, region.stop - gpe + 1, gpe))
    else:
        for node in range(topology.num_nodes):
            on_node = [s for s in region if s // gpn == node]
            starts += on_node[: len(on_node) - len(on_node) % gpe : gpe] if on_node else []
    if wanted > len(starts):
        raise PlanError(
            f"rollout: {wanted} engine(s) of rollout.gpus_per_engine={gpe} GPUs do not fit the rollout GPUs "
            f"{region.start}..{region.stop - 1} of topology={topology.name} ({topology.num_nodes} node(s) x {gpn}) "
            f"without an engine straddling two nodes: {len(starts)} fit. Fix: rollout.num_engines <= {len(starts)}, "
            "or a gpus_per_engine that divides the rollout GPUs of each node."
        )
    specs = []
    for i, start in enumerate(starts[:wanted]):
        slots = tuple(range(start, start + gpe))
        nodes = sorted({s // gpn for s in slots})
        groups = tuple(tuple(w for w, s in enumerate(slots) if s // gpn == n) for n in nodes)
        specs.append(EngineSpec(i, slots, groups, 1 + gpe, 1, 1 + i * gpe))
    return tuple(specs)
