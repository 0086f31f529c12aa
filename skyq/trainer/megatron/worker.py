"""MegatronTrainerWorker: the trainer worker of trainer=megatron, the driver's one trainer actor.

It is rank 0 of the Megatron world and starts ranks 1 .. world_size - 1 as Ray actors
(`group.RankGroup`); every call that is a collective of the world (train_step, the weight export of
a sync or a digest, save, load) runs on all ranks at once and answers with rank 0's result, or with
the first rank's error, naming it. Only rank 0 talks to the engines: it holds their sync stores and
channels and sends what the export gathered, exactly as `skyq.launch.actors.TrainerWorker` does.

Checkpoints (`save_state(path)`): megatron dist-checkpointing writes every rank's shards of weights
and optimizer state into a directory beside `path` (`trainer.megatron-<id>`); `path` itself (the
run checkpoint's trainer.pt, whose sha256 the driver records) is a JSON manifest naming that
directory, the step and the sha256 of every file in it, written last (temp + fsync + rename). A
load checks every file against the manifest before megatron reads any of it: torch's distributed
checkpoint unpickles its metadata, so only bytes this trainer wrote and the manifest vouches for are
read. The save is synchronous (a collective of every rank): `start_save_state` writes and commits
the checkpoint before it returns, and `wait_save_state` hands back its directory.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import time
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from skyq.checkpoint.atomic import atomic_replace, fsync_dir
from skyq.config.resolve import WorkerResolution
from skyq.config.schema import AlgorithmConfig, ModelConfig, ParallelConfig, PrecisionConfig, TrainerConfig
from skyq.launch.actors import resolve_on_device
from skyq.launch.checkpointing import PendingCheckpoint, sha256_file
from skyq.quant.layouts import experts as expert_layout
from skyq.quant.layouts import get_layout
from skyq.quant.plan import build_plan
from skyq.quant.strategies import get_strategy
from skyq.rl.batch import RolloutBatch
from skyq.rl.grpo import mismatch_metrics, policy_loss
from skyq.sync.engine_senders import EngineSenders, SendsToEngines
from skyq.sync.plan_wire import WireDigest, plan_serializer, wire_digest
from skyq.sync.sender import WeightItem
from skyq.trainer.megatron.group import RankGroup
from skyq.trainer.megatron.trainer import loss_kwargs

MANIFEST_FORMAT = "skyq-megatron-checkpoint/1"
"""The `format` of the manifest `save_state` writes at the driver's trainer.pt path."""


class MegatronCheckpointError(ValueError):
    """A trainer=megatron checkpoint that is missing, damaged or not one."""


def world_layout(parallel_cfg: ParallelConfig, *, device: str, trainer_gpus: int) -> ParallelConfig:
    """`parallel_cfg` with dp resolved: as set, else trainer GPUs / (tp * pp * cp) on GPUs, 1 on the CPU."""
    model_parallel = parallel_cfg.tp * parallel_cfg.pp * parallel_cfg.cp
    dp = parallel_cfg.dp
    if dp is None:
        dp = 1 if torch.device(device).type != "cuda" else max(1, trainer_gpus // model_parallel)
    world = model_parallel * dp
    if torch.device(device).type == "cuda" and world > trainer_gpus:
        raise ValueError(
            f"topology.parallel tp*pp*cp*dp = {world} ranks, topology.trainer_gpus={trainer_gpus}: one GPU per "
            "rank; lower the parallel sizes or give the trainer more GPUs"
        )
    return dataclasses.replace(parallel_cfg, dp=dp)


def world_size(parallel_cfg: ParallelConfig) -> int:
    """Ranks of the world of a resolved layout."""
    assert parallel_cfg.dp is not None
    return parallel_cfg.tp * parallel_cfg.pp * parallel_cfg.cp * parallel_cfg.dp


class MegatronTrainerWorker(SendsToEngines):
    """The Megatron trainer's world (rank 0 here, the rest as Ray actors) plus the sending end of
    the weight sync."""

    def __init__(
        self,
        *,
        model_cfg: ModelConfig,
        precision_cfg: PrecisionConfig,
        trainer_cfg: TrainerConfig,
        algorithm_cfg: AlgorithmConfig,
        parallel_cfg: ParallelConfig,
        checkpoint_path: str,
        device: str,
        seed: int,
        temperature: float,
        load_path: str | None = None,
        ref_load: str | None = None,
        trainer_gpus: int = 0,
        peer_env: dict[str, str] | None = None,
        peer_secret_env_names: tuple[str, ...] = (),
        timeout_s: float = 1800.0,
    ) -> None:
        """`parallel_cfg`: topology.parallel (dp None: resolved by `world_layout`). `load_path`:
        checkpoint.load, a trainer=megatron checkpoint (its trainer.pt or step directory) or a
        megatron dist-checkpoint directory the weights boot from instead of `checkpoint_path`.
        `peer_env`: environment variables of the peer ranks' actors (the trainer's non-secret
        ones); `peer_secret_env_names`: the secret ones, which reach the peers as they reached this
        actor (owner-only files, `RankGroup`). `timeout_s` bounds every collective of the world (the worker-call deadline)."""
        start = time.perf_counter()
        torch.manual_seed(seed)
        self.model_cfg, self.precision_cfg = model_cfg, precision_cfg
        self.algorithm_cfg = algorithm_cfg
        self.parallel = world_layout(parallel_cfg, device=device, trainer_gpus=trainer_gpus)
        self.world_size = world_size(self.parallel)
        cuda = torch.device(device).type == "cuda"
        peer_options: dict[str, Any] = {"num_cpus": 0, "num_gpus": 1 if cuda else 0, "max_restarts": 0}
        if peer_env:
            peer_options["runtime_env"] = {"env_vars": dict(peer_env)}
        self.group = RankGroup(
            world_size=self.world_size,
            timeout_s=timeout_s,
            peer_options=peer_options,
            secret_env_names=tuple(peer_secret_env_names),
            trainer_kwargs={
                "model_cfg": model_cfg,
                "precision_cfg": precision_cfg,
                "trainer_cfg": trainer_cfg,
                "algorithm_cfg": algorithm_cfg,
                "parallel_cfg": self.parallel,
                "checkpoint_path": checkpoint_path,
                "load_path": boot_directory(load_path),
                "ref_load": ref_load,
                "device": device,
                "seed": seed,
                "temperature": temperature,
            },  # fmt: skip
        )
        self.layout = get_layout(model_cfg.family)
        self.plan = build_plan(model_cfg, precision_cfg)
        self.serialize = plan_serializer(get_strategy(precision_cfg), self.plan)
        self.resolution = resolve_on_device(precision_cfg, device)
        self.build_s = time.perf_counter() - start
        """Seconds the constructor took (every rank's model build): start-up feedback."""
        self._timeout_s = timeout_s
        self.senders = EngineSenders(self.serialize)
        """The sending end of the sync to every engine (rank 0 only; `skyq.sync.engine_senders`)."""
        self._saved: str | None = None

    def report_resolution(self) -> WorkerResolution:
        return self.resolution

    def build_seconds(self) -> float:
        return self.build_s

    # weights -------------------------------------------------------------------------------------

    def _exported(self) -> tuple[list[tuple[str, torch.Tensor]], float]:
        """Every (HF name, full tensor) of the current weights, gathered by the world's export
        (rank 0 keeps them, the peers take part and drop theirs); and the seconds it took."""
        start = time.perf_counter()
        pairs, _ = self.group.run_with_peers(
            lambda: list(self.group.trainer.hf_weights()), "drain_weights", "weight export"
        )
        return pairs, time.perf_counter() - start

    def send_weights(self, version: int, bucket_bytes: int) -> dict[str, float]:
        """Export the weights once (a collective of the world) and send them as `version` to every
        engine, one after the other; the sync metrics, times summed over the engines, the export's
        time in sync/gather_s. Routed experts go as one stack per projection."""
        pairs, export_s = self._exported()
        items = list(stacked_items(pairs, self.model_cfg, self.layout))
        total = self.senders.send(lambda: items, version, bucket_bytes)
        total["sync/gather_s"] = total.get("sync/gather_s", 0.0) + export_s
        total["sync/total_s"] = total.get("sync/total_s", 0.0) + export_s
        return total

    def serialized_digest(self) -> WireDigest:
        """Digest of what the strategy serializes from the current weights, one tensor at a time."""
        pairs, _ = self._exported()
        return wire_digest({n: t for name, w in pairs for n, t in self.serialize(name, w).items()})

    # training ------------------------------------------------------------------------------------

    def logprobs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """[B, T] fp32 token log-probs of the current weights (`NativeTrainer.logprobs`; no update)."""
        first, others = self.group.call("logprobs", input_ids, attention_mask)
        return torch.cat([s["logp"] for s in _by_dp_rank([first, *others])])

    def train_step(self, batch: RolloutBatch) -> dict[str, float]:
        """One GRPO update of the world on `batch`; the native trainer's metrics, computed on rank 0
        from the log-probs every DP share returned."""
        first, others = self.group.call("train_step", batch)
        ordered = _by_dp_rank([first, *others])
        old_logp = torch.cat([s["logp"] for s in ordered])
        ref_logp = torch.cat([s["ref_logp"] for s in ordered]) if first["ref_logp"] is not None else None
        _, metrics = policy_loss(
            old_logp, old_logp, batch.rollout_logprobs, batch.advantages, batch.response_mask,
            ref_logp=ref_logp, **loss_kwargs(self.algorithm_cfg),
        )  # fmt: skip
        metrics.update(mismatch_metrics(old_logp, batch.rollout_logprobs, batch.response_mask))
        metrics.update(
            grad_norm=first["grad_norm"], lr=first["lr"], step=float(first["step"]),
            reward_mean=float(batch.rewards.mean()),
            response_tokens_mean=float(batch.response_mask.sum()) / len(batch),
        )  # fmt: skip
        return metrics

    # checkpoints ---------------------------------------------------------------------------------

    def save_state(self, path: str) -> str:
        """Write every rank's shards beside `path`, then the manifest at `path`; its sha256."""
        manifest = Path(path)
        directory = manifest.with_name(f"{manifest.stem}.megatron-{uuid.uuid4().hex[:8]}")
        directory.mkdir()
        try:
            self.group.call("save_checkpoint", str(directory))
            files = {}
            for file in sorted(p for p in directory.rglob("*") if p.is_file()):
                with open(file, "rb") as f:
                    os.fsync(f.fileno())
                files[file.relative_to(directory).as_posix()] = sha256_file(file)
            for sub in sorted({p.parent for p in directory.rglob("*")} | {directory}):
                fsync_dir(sub)
            fsync_dir(directory.parent)
            body = {
                "format": MANIFEST_FORMAT, "step": self.group.trainer.step,
                "directory": directory.name, "files": files,
            }  # fmt: skip
            data = json.dumps(body, indent=1, sort_keys=True).encode()
            with atomic_replace(manifest) as tmp, open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        except BaseException:
            shutil.rmtree(directory, ignore_errors=True)
            raise
        for old in manifest.parent.glob(f"{manifest.stem}.megatron-*"):  # earlier saves to this path
            if old != directory:
                shutil.rmtree(old, ignore_errors=True)
        return hashlib.sha256(data).hexdigest()

    def start_save_state(self, checkpoint: PendingCheckpoint) -> None:
        """Save (a collective: synchronous) and commit `checkpoint` now; `wait_save_state` returns it."""
        self._refuse_while_saving("start_save_state")
        self._saved = str(checkpoint.finish(self.save_state(str(checkpoint.trainer_path))))

    def wait_save_state(self) -> str:
        """The directory `start_save_state` committed."""
        saved, self._saved = self._saved, None
        if saved is None:
            raise RuntimeError("wait_save_state: no save in flight (start_save_state first)")
        return saved

    def _refuse_while_saving(self, what: str) -> None:
        if self._saved is not None:
            raise RuntimeError(f"{what}: the save of {self._saved} was not collected; wait_save_state first")

    def load_state(self, path: str) -> int:
        """Restore what `save_state` wrote at `path` (every shard checked first); the step."""
        directory = verified_directory(Path(path))
        step, _ = self.group.call("load_checkpoint", str(directory))
        return step

    def close(self) -> None:
        self.senders.close()
        self.group.close()


def _by_dp_rank(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One result per DP share (the ranks of one share return the same rows), in row order."""
    shares: dict[int, dict[str, Any]] = {}
    for result in results:
        shares.setdefault(result["dp_rank"], result)
    return [shares[d] for d in sorted(shares)]


def stacked_items(
    pairs: Iterable[tuple[str, torch.Tensor]], model_cfg: ModelConfig, layout: Any
) -> Iterator[WeightItem]:
    """`(HF name, tensor)` pairs as the sender's items: every routed expert projection of a layer
    as one `(names, stack)` (`TrainerWorker`'s stacked sync), the rest as they are; in the layout's
    order, a stack where its first expert would be."""
    items: dict[str, WeightItem] = {}
    groups: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    for name, tensor in pairs:
        parsed = expert_layout.parse_expert_name(name)
        if parsed is None:
            items[name] = (name, tensor)
            continue
        module, expert, projection = parsed
        groups.setdefault((module, projection), {})[expert] = tensor
    for (module, projection), members in groups.items():
        experts = sorted(members)
        names = tuple(f"{module}.{e}.{projection}.weight" for e in experts)
        items[names[0]] = (names, torch.stack([members[e] for e in experts]))
    for spec in layout.hf_parameters(model_cfg):
        if spec.name in items:
            yield items.pop(spec.name)
    if items:
        raise MegatronCheckpointError(f"the export yielded tensors outside the layout: {sorted(items)[:5]}")


def read_manifest(path: Path) -> dict[str, Any]:
    """The manifest `save_state` wrote at `path`, or an error naming the file."""
    try:
        body = json.loads(path.read_bytes())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise MegatronCheckpointError(
            f"{path}: not a trainer=megatron checkpoint manifest ({type(exc).__name__}); a trainer=torch "
            "trainer.pt does not load into trainer=megatron"
        ) from None
    if not isinstance(body, dict) or body.get("format") != MANIFEST_FORMAT:
        raise MegatronCheckpointError(f"{path}: not a {MANIFEST_FORMAT} manifest")
    return body


def verified_directory(path: Path) -> Path:
    """The shard directory of the manifest at `path`, every file's sha256 checked against it."""
    body = read_manifest(path)
    directory = path.parent / body["directory"]
    if not directory.is_dir():
        raise MegatronCheckpointError(f"{path}: its shard directory {directory} is missing")
    have = {p.relative_to(directory).as_posix() for p in directory.rglob("*") if p.is_file()}
    want = body["files"]
    if have != set(want):
        raise MegatronCheckpointError(
            f"{directory}: files differ from the manifest {path} (missing {sorted(set(want) - have)[:3]}, "
            f"unexpected {sorted(have - set(want))[:3]})"
        )
    for name, digest in want.items():
        if sha256_file(directory / name) != digest:
            raise MegatronCheckpointError(
                f"{directory / name}: sha256 differs from the manifest {path}; damaged"
            )
    return directory


def boot_directory(load_path: str | None) -> str | None:
    """checkpoint.load as the dist-checkpoint directory to boot from: a trainer=megatron manifest
    (trainer.pt) or a run checkpoint directory holding one is verified and resolved to its shards;
    any other directory is taken as a megatron dist checkpoint as it is."""
    if load_path is None:
        return None
    path = Path(load_path).expanduser().resolve()
    if path.is_dir() and (path / "trainer.pt").is_file():
        path = path / "trainer.pt"
    if path.is_file():
        return str(verified_directory(path))
    if not path.is_dir():
        raise MegatronCheckpointError(f"checkpoint.load={load_path}: no such file or directory")
    return str(path)
