"""The trainer and the rollout engine workers, and the weight-sync channel between them.

`TrainerWorker` and `EngineWorker` are plain classes: `skyq.launch.actor_pair` runs them as Ray
actors joined by a torch.distributed group (gloo on CPU, NCCL between distinct GPUs), and
`skyq.launch.local_pair` runs both in the driver process joined by an in-process channel. Weights
reach the engine only through the sync channel: never as Ray arguments, which would pickle fp8
tensors.
"""

from __future__ import annotations

import hashlib
import io
import os
import threading
import time
from pathlib import Path
from typing import Any

import torch

from skyq.checkpoint.atomic import atomic_replace
from skyq.config.enums import ComputeDtype, Fp8Gemm
from skyq.config.resolve import WorkerResolution, resolve_worker
from skyq.config.schema import AlgorithmConfig, ModelConfig, OptimizerConfig, PrecisionConfig
from skyq.launch.checkpointing import PendingCheckpoint, RunCheckpointError
from skyq.quant.plan import build_plan
from skyq.quant.strategies import get_strategy
from skyq.rl.batch import RolloutBatch, Sample
from skyq.rollout.embedded import EmbeddedEngine
from skyq.sync.channel import Channel
from skyq.sync.engine_senders import EngineSenders, SendsToEngines
from skyq.sync.plan_wire import WireDigest, expected_units, plan_serializer, wire_digest
from skyq.sync.receiver import WeightReceiver
from skyq.sync.torch_dist import RECEIVER_RANK, TorchDistChannel, connect_store
from skyq.trainer.native.trainer import NativeTrainer


def resolve_on_device(precision_cfg: PrecisionConfig, device: str) -> WorkerResolution:
    """This worker's resolution of fp8_recipe / scale format, from its own device (None on a CPU)."""
    dev = torch.device(device)
    capability = torch.cuda.get_device_capability(dev) if dev.type == "cuda" else None
    return resolve_worker(precision_cfg, capability)


class TrainerWorker(SendsToEngines):
    """The native trainer plus the sending end of the weight sync."""

    def __init__(
        self,
        *,
        model_cfg: ModelConfig,
        precision_cfg: PrecisionConfig,
        optimizer_cfg: OptimizerConfig,
        algorithm_cfg: AlgorithmConfig,
        micro_batch_size: int,
        checkpoint_path: str,
        device: str,
        seed: int,
        temperature: float,
        fp8_gemm: Fp8Gemm = Fp8Gemm.off,
        compute_dtype: ComputeDtype = ComputeDtype.fp32,
    ) -> None:
        start = time.perf_counter()
        torch.manual_seed(seed)
        self.trainer = NativeTrainer(
            model_cfg=model_cfg,
            precision_cfg=precision_cfg,
            optimizer_cfg=optimizer_cfg,
            algorithm_cfg=algorithm_cfg,
            micro_batch_size=micro_batch_size,
            checkpoint_path=checkpoint_path,
            device=device,
            seed=seed,
            # log-probs of the policy the engine samples from (logits / rollout.temperature)
            temperature=temperature,
            fp8_gemm=fp8_gemm,
            compute_dtype=compute_dtype,
        )
        self.plan = build_plan(model_cfg, precision_cfg)
        self.serialize = plan_serializer(get_strategy(precision_cfg), self.plan)
        self.resolution = resolve_on_device(precision_cfg, device)
        self.build_s = time.perf_counter() - start
        """Seconds the constructor took (model build): start-up feedback."""
        self.senders = EngineSenders(self.serialize)
        """The sending end of the sync to every engine (`skyq.sync.engine_senders`)."""

    def report_resolution(self) -> WorkerResolution:
        return self.resolution

    def build_seconds(self) -> float:
        return self.build_s

    def send_weights(self, version: int, bucket_bytes: int) -> dict[str, float]:
        """Serialize the current weights and send them as `version` to every engine of the group, one
        engine after the other (each verifies and commits its copy); returns the sync metrics, times
        summed over the engines.

        Routed experts go as one stack per projection (one quantizer call each); the wire is
        bit-identical to serializing every expert's tensor on its own (`serialized_digest`)."""
        return self.senders.send(self.trainer.hf_weight_items, version, bucket_bytes)

    def serialized_digest(self) -> WireDigest:
        """Digest of what the strategy serializes from the current weights (what a sync would send),
        one tensor at a time: the reference the stacked sync is checked against."""
        wire = {n: t for name, w in self.trainer.hf_weights() for n, t in self.serialize(name, w).items()}
        return wire_digest(wire)

    def train_step(self, batch: RolloutBatch) -> dict[str, float]:
        return self.trainer.train_step(batch)

    _saving: _BackgroundSave | None = None
    """The background save in flight (`start_save_state`), if any."""

    def snapshot_state(self) -> dict[str, Any]:
        """What a checkpoint holds, copied to CPU memory now: weights, optimizer, step and RNG state.

        `NativeTrainer.state_dict` clones; tensors on a GPU are then copied to the host, so the
        snapshot needs no device memory while it is written and training cannot change it."""
        return {"trainer": _to_cpu(self.trainer.state_dict()), "rng": {"torch": torch.get_rng_state()}}

    def save_state(self, path: str) -> str:
        """Write weights, optimizer and RNG state to `path` (crash-safe) now; returns its sha256."""
        self._refuse_while_saving("save_state")
        return write_trainer_state(Path(path), self.snapshot_state())

    def start_save_state(self, checkpoint: PendingCheckpoint) -> None:
        """Snapshot the state now and write it as `checkpoint`'s trainer.pt on a background thread,
        which then finishes the checkpoint (run_state.json, rename into place) at once; returns at once.

        The file is what `save_state` would have written at this moment. `wait_save_state` gives the
        checkpoint's directory (or the error); one background save at a time."""
        self._refuse_while_saving("start_save_state")
        self._saving = _BackgroundSave(checkpoint, self.snapshot_state())

    def wait_save_state(self) -> str:
        """Wait for the background save; returns the finished checkpoint's directory, or raises
        `RunCheckpointError` naming the file and the error (the temp directory is then gone)."""
        saving, self._saving = self._saving, None
        if saving is None:
            raise RuntimeError("wait_save_state: no background save in flight (start_save_state first)")
        return saving.result()

    def drop_save_state(self) -> None:
        """Let a background save end and forget it (its temp file is removed on error)."""
        saving, self._saving = self._saving, None
        if saving is not None:
            saving.thread.join()

    def _refuse_while_saving(self, what: str) -> None:
        saving = self._saving
        if saving is not None:
            raise RuntimeError(
                f"{what}: a background save to {saving.path} is in flight; wait_save_state first"
            )

    def load_state(self, path: str) -> int:
        """Restore what `save_state` wrote (the caller verified its sha256); returns the trainer's step."""
        self._refuse_while_saving("load_state")
        # weights_only: a checkpoint is data, never code.
        state = torch.load(path, map_location=self.trainer.device, weights_only=True)
        self.trainer.load_state_dict(state["trainer"])
        torch.set_rng_state(state["rng"]["torch"])
        return self.trainer.step

    def close(self) -> None:
        self.senders.close()


def _to_cpu(obj: Any) -> Any:
    """`obj` with every tensor on the CPU (tensors already there are kept, not copied again)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu")
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_cpu(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_to_cpu(v) for v in obj)
    return obj


class _HashingFile:
    """A write-only stream for `torch.save` that hashes the bytes as they go to `file`."""

    def __init__(self, file: io.BufferedWriter) -> None:
        self._file = file
        self.digest = hashlib.sha256()

    def write(self, data: bytes | memoryview) -> int:
        written = self._file.write(data)  # a buffered write takes all of it or raises
        self.digest.update(data)
        return written

    def flush(self) -> None:
        self._file.flush()


def write_trainer_state(path: Path, state: dict[str, Any]) -> str:
    """`torch.save` of `state` to `path` via temp + fsync + rename, hashed while it is written (no
    in-memory copy of the file); returns the sha256 of the bytes written."""
    with atomic_replace(path) as tmp, open(tmp, "wb") as f:
        stream = _HashingFile(f)
        torch.save(state, stream)
        f.flush()
        os.fsync(f.fileno())
    return stream.digest.hexdigest()


class _BackgroundSave:
    """One `write_trainer_state` on a daemon thread, then the checkpoint finished (committed) on the
    same thread; the snapshot is dropped once it is written."""

    def __init__(self, checkpoint: PendingCheckpoint, state: dict[str, Any]) -> None:
        self.checkpoint = checkpoint
        self.path = checkpoint.trainer_path
        self._state: dict[str, Any] | None = state
        self._final: Path | None = None
        self._error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="skyq-checkpoint-write", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            assert self._state is not None
            try:
                sha256 = write_trainer_state(self.path, self._state)
            except BaseException as exc:
                raise RunCheckpointError(
                    f"{self.path}: writing the trainer state in the background failed: "
                    f"{type(exc).__name__}: {exc}"
                ) from exc
            finally:
                self._state = None
            self._final = self.checkpoint.finish(sha256)
        except BaseException as exc:  # handed to the caller of `result`
            self.checkpoint.abort()
            self._error = exc

    def result(self) -> str:
        self.thread.join()
        if self._error is not None:
            raise self._error
        assert self._final is not None
        return str(self._final)


class EngineWorker:
    """The embedded rollout engine plus the receiving end of the weight sync."""

    def __init__(
        self,
        *,
        model_cfg: ModelConfig,
        precision_cfg: PrecisionConfig,
        device: str,
        seed: int,
        eos_token_id: int,
        cuda_graphs: bool = True,
        fp8_codes_decode: bool = True,
        rollout_checkpoint: str | None = None,
    ) -> None:
        """`rollout_checkpoint`: a checkpoint in the precision's wire format the engine boots from as
        version 0 (the seed's two-checkpoint layout: the W4A16 release while the trainer starts from
        its BF16 cast); None: it serves nothing until the first sync."""
        start = time.perf_counter()
        self.engine = EmbeddedEngine(
            model_cfg=model_cfg,
            precision_cfg=precision_cfg,
            device=device,
            seed=seed,
            eos_token_id=eos_token_id,
            cuda_graphs=cuda_graphs,
            fp8_codes_decode=fp8_codes_decode,
        )
        if rollout_checkpoint is not None:
            self.engine.load_checkpoint(rollout_checkpoint)
        self.expected = expected_units(build_plan(model_cfg, precision_cfg))
        self.resolution = resolve_on_device(precision_cfg, device)
        self.build_s = time.perf_counter() - start
        """Seconds the constructor took (engine boot): start-up feedback."""
        self._channel: Channel | None = None
        self._receiver: WeightReceiver | None = None
        """One receiver per channel: it keeps the layout of the last committed sync."""

    def report_resolution(self) -> WorkerResolution:
        return self.resolution

    def build_seconds(self) -> float:
        return self.build_s

    def use_channel(self, channel: Channel) -> None:
        """Receive over `channel` (an in-process pair's receiver end)."""
        self._channel, self._receiver = channel, None

    def join_sync_group(self, port: int, timeout_s: float, sync_device: str) -> None:
        store = connect_store(port, timeout_s)
        self._channel = TorchDistChannel(
            store, rank=RECEIVER_RANK, timeout_s=timeout_s, device=torch.device(sync_device)
        )
        self._receiver = None

    def receive_weights(self, verify_checksum: bool) -> dict[str, float]:
        """Take part in one sync; the engine's weights and version change only if it fully succeeds."""
        if self._receiver is None or self._receiver_verifies != verify_checksum:
            # frames that cross on the host (gloo, trainer=megatron on the engine's GPU) are moved to
            # the engine's device once per bucket, before the checksum and value scans
            self._receiver = WeightReceiver(
                self._channel, self.expected, verify_checksum=verify_checksum, device=self.engine.device
            )
            self._receiver_verifies = verify_checksum
        stats = self._receiver.receive(
            current_version=self.engine.weight_version, commit=self.engine.load_weights
        )
        return {"version": stats.version, "recv_s": stats.recv_s, "load_s": stats.load_s}

    def generate(self, prompts: list[list[int]], **sampling: Any) -> list[Sample]:
        return self.engine.generate(prompts, **sampling)

    def score(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, temperature: float
    ) -> torch.Tensor:
        return self.engine.score(input_ids, attention_mask, temperature=temperature)

    def weight_version(self) -> int:
        return self.engine.weight_version

    def wire_digest(self) -> WireDigest:
        return wire_digest(self.engine.wire_state())

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()
