"""MegatronTrainer: one rank of the Megatron-core GRPO trainer (trainer=megatron).

Every rank of the Megatron world (tp * pp * cp * dp processes) holds one `MegatronTrainer`; the
worker (`skyq.trainer.megatron.worker`) calls the same method on all of them at once. A rank joins
the world's default torch.distributed group (gloo on CPU, NCCL on GPU) on a store rank 0 holds,
initialises megatron's parallel state, builds its shards of the GPTModel (`model.build_model`),
loads them from the HF checkpoint (`mapping.load_hf_checkpoint`) or from `checkpoint.load`, and wraps
them in megatron's DistributedDataParallel and distributed optimizer.

The update is the native trainer's (`skyq.trainer.native.trainer`), step for step: token log-probs
of logits / temperature (vocab-parallel cross-entropy, so TP never gathers the vocabulary), the same
GRPO loss (`skyq.rl.grpo.policy_loss`) normalised by the whole batch's response-token count, one
AdamW step with the same warm-up and global-norm clip. Data parallel: rank 0 hands every rank the
whole batch and each takes its contiguous share of rows; the loss of every share is divided by the
batch's token count and DDP sums (not averages) the shares' gradients
(`calculate_per_token_loss`), so the gradient is the one a world of one computes.

Choices, and why:
- Megatron's own schedule (`get_forward_backward_func`: no pipelining at pp = 1, the
  non-interleaved 1F1B schedule at pp > 1) runs the micro-batches, for the update and for the
  log-probs alike. The GRPO loss and the log-probs are computed on the last pipeline stage, which
  then broadcasts the log-probs over its pipeline group, so every rank (rank 0, the first stage,
  faces the loop) returns the same rows. The loss of a micro-batch is already divided by the
  batch's token count, so the schedule scales nothing (`calculate_per_token_loss`) and the
  gradients are finalized here (`finalize_model_grads`: DP reduction, sequence-parallel norms, the
  tied embedding's gradient summed between the first and last stage), not by the schedule. Virtual
  pipeline stages (interleaving) and context parallel are refused (`check_supported`).
- The distributed optimizer always (one code path, and its checkpoint reshards across DP sizes);
  at dp = 1 it is megatron's plain mixed-precision optimizer with one shard.
- Every DP rank runs the same number of micro-batches of the same size (the batch is padded with
  rows that carry no response token): expert parallelism exchanges tokens inside every forward, so
  ranks that disagree on the number of forwards would wait on each other forever.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from skyq.config.enums import ISCorrection
from skyq.config.schema import (
    AlgorithmConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelConfig,
    PrecisionConfig,
    TrainerConfig,
)
from skyq.rl.batch import RolloutBatch
from skyq.rl.grpo import policy_loss
from skyq.trainer.native.trainer import position_ids_of

CHECKPOINT_FORMAT = "skyq-megatron-dist/1"
"""The `format` entry of what a rank saves next to its shards (checked on load)."""

DISTRIB_OPTIM_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}
"""How the distributed optimizer lays its state out in a checkpoint: each rank writes its own
buffers (no gather); the state reloads into the same TP / EP / PP layout, any DP size (a resume
keeps the run's config, so its layout)."""


def check_supported(*, parallel_cfg: ParallelConfig, optimizer_cfg: OptimizerConfig, device: str) -> None:
    """Refuse, with the reason, a layout or optimizer setting this trainer cannot run on `device`."""
    problems = []
    if parallel_cfg.cp != 1:
        problems.append(
            f"topology.parallel.cp={parallel_cfg.cp}: context parallel needs each sequence split across "
            "the CP ranks, which this trainer does not do; use cp=1"
        )
    if parallel_cfg.tp > 1 and not parallel_cfg.sequence_parallel:
        problems.append(
            f"topology.parallel.tp={parallel_cfg.tp} without sequence parallelism: megatron-core's MoE layer "
            "refuses to train so (MoELayer.forward, at the first update); set "
            "topology.parallel.sequence_parallel=true"
        )
    if parallel_cfg.sequence_parallel and parallel_cfg.tp == 1:
        problems.append("topology.parallel.sequence_parallel=true needs topology.parallel.tp > 1")
    if optimizer_cfg.overlap_cpu_offload and not optimizer_cfg.cpu_offload:
        problems.append(
            "trainer.optimizer.overlap_cpu_offload=true overlaps the copies of an offloaded optimizer: "
            "set trainer.optimizer.cpu_offload=true too, or overlap_cpu_offload=false"
        )
    if optimizer_cfg.cpu_offload and not optimizer_cfg.precision_aware:
        problems.append(
            "trainer.optimizer.cpu_offload=true needs trainer.optimizer.precision_aware=true: megatron-core's "
            "HybridDeviceOptimizer reuses the precision-aware path (0.19.2 raises KeyError loading a "
            "checkpoint of an offloaded optimizer without it)"
        )
    if torch.device(device).type != "cuda":
        if optimizer_cfg.cpu_offload:
            problems.append(
                "trainer.optimizer.cpu_offload=true on topology.device=cpu: the optimizer state lives in "
                "host memory already; set it false"
            )
        if optimizer_cfg.precision_aware:
            problems.append(
                "trainer.optimizer.precision_aware=true needs Transformer Engine's FusedAdam (low-precision "
                "moments), which exists on GPUs only; set it false on topology.device=cpu"
            )
    if problems:
        raise ValueError("; ".join(problems))


def learning_rate(optimizer_cfg: OptimizerConfig, algorithm_cfg: AlgorithmConfig, step: int) -> float:
    """`NativeTrainer.learning_rate`: linear warm-up over optimizer.lr_warmup_steps, then algorithm.lr."""
    warmup = optimizer_cfg.lr_warmup_steps
    scale = min(1.0, (step + 1) / warmup) if warmup > 0 else 1.0
    return algorithm_cfg.lr * scale


def loss_kwargs(algorithm_cfg: AlgorithmConfig) -> dict[str, Any]:
    """The clip / IS / KL arguments of `policy_loss` (the native trainer's `_loss_kwargs`)."""
    a = algorithm_cfg
    return {
        "clip_eps_low": a.clip_eps_low, "clip_eps_high": a.clip_eps_high,
        "is_correction": ISCorrection(a.is_correction), "is_cap": a.is_cap, "is_low": a.is_low,
        "is_high": a.is_high, "kl_coef": a.kl_coef,
    }  # fmt: skip


def pad_rows(batch: RolloutBatch, rows: int, columns: int) -> RolloutBatch:
    """`batch` grown to `rows` x `columns` with padding that no loss sees (masks and advantages 0).

    Sequences are right-padded already; extra columns are more of the same, and a causal forward
    gives real tokens the same logits whatever follows them."""
    b, t = batch.input_ids.shape
    if (rows, columns) == (b, t):
        return batch

    def grow(x: Tensor) -> Tensor:
        out = x.new_zeros((rows, columns) if x.ndim == 2 else (rows,))
        if x.ndim == 2:
            out[:b, :t] = x
        else:
            out[:b] = x
        return out

    return RolloutBatch(**{f.name: grow(getattr(batch, f.name)) for f in dataclasses.fields(RolloutBatch)})


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _mixed_precision(model: torch.nn.Module) -> torch.nn.Module:
    """`model` in megatron's `Float16Module` when its config computes in bf16 (the parameters cast
    to bf16, the logits back to fp32; the optimizer keeps fp32 masters): the native trainer's
    compute_dtype=bf16. fp32 configs are returned as they are."""
    from megatron.core.transformer.module import Float16Module

    config = model.config
    return Float16Module(config, model) if config.bf16 or config.fp16 else model


def optimizer_cpu_compat() -> None:
    """What megatron-core 0.16.1's optimizer and dist-checkpointing need on a torch without CUDA, on
    top of `cpu_compat.apply()` (the model's): their modules build small tensors with
    `device="cuda"` unconditionally. `optimizer.py` (`MixedPrecisionOptimizer`'s found-inf flag and
    scale, `FP32Optimizer._scale`), `clip_grads.py` (the global grad norm and its zero counts) and
    `utils.py` (`local_multi_tensor_l2_norm`, the grad norm without apex / TE) get a `torch` whose factories allocate those on the CPU; `torch.cuda.synchronize` (called by
    the dist-checkpointing save and load) is a no-op, every CPU op being synchronous. No-op with CUDA."""
    if torch.cuda.is_available():
        return
    from megatron.core import utils as mcore_utils
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as mcore_optimizer

    from skyq.trainer.megatron import cpu_compat

    cpu_compat.apply()  # also makes torch.cuda.synchronize a no-op
    cpu_torch = cpu_compat.CpuAllocatingTorch()
    for module in (mcore_optimizer, clip_grads, mcore_utils):
        module.torch = cpu_torch


@contextlib.contextmanager
def cuda_type_names() -> Iterator[None]:
    """While megatron-core 0.16.1 builds its optimizer, a CPU tensor's `type()` reads as its CUDA
    twin's (`torch.BFloat16Tensor` -> `torch.cuda.BFloat16Tensor`): `DistributedOptimizer` and
    `Float16OptimizerWithFloat16Params` sort parameters into fp32 / half groups by those names and
    refuse any other, and the gradient clip asserts fp32 "CUDA" gradients: the optimizer is built and
    stepped inside this. No-op with CUDA."""
    if torch.cuda.is_available():
        yield
        return
    original = torch.Tensor.type

    def type_name(self: Tensor, dtype: Any = None, *args: Any, **kwargs: Any) -> Any:
        if dtype is not None or args or kwargs:
            return original(self, dtype, *args, **kwargs)
        name = original(self)
        return name.replace("torch.", "torch.cuda.", 1) if self.device.type == "cpu" else name

    torch.Tensor.type = type_name
    try:
        yield
    finally:
        torch.Tensor.type = original


def in_process_checkpoint_writes() -> None:
    """Make megatron-core 0.16.1's dist-checkpoint save write its files in the calling process.

    Its torch_dist writer (`FileSystemWriterAsync`) forks one process per file bucket and collects
    their results through a `multiprocessing` Manager it spawns; a fork of a Ray worker (many
    threads: gRPC, gloo, the sync channels) can deadlock in the child on a lock another thread held,
    so a save would hang. Here each bucket is written by the same function, one after the other, in
    this process, and the results go through a plain queue: the same files, fsynced, the same
    metadata. Idempotent; a no-op on megatron-core 0.19, whose writer uses threads (it has no
    `write_preloaded_data_multiproc`, and `strategies.torch` imports the writer lazily: patching it
    there raised AttributeError on the H200)."""
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from megatron.core.dist_checkpointing.strategies import torch as torch_strategy

    base = filesystem_async.FileSystemWriterAsync
    if not hasattr(base, "write_preloaded_data_multiproc") or not hasattr(
        torch_strategy, "FileSystemWriterAsync"
    ):
        return  # megatron-core 0.19 writes the buckets with threads of this process: nothing forks
    if torch_strategy.FileSystemWriterAsync is not base:
        return

    class InProcessWriter(base):
        @staticmethod
        def write_preloaded_data_multiproc(
            transform_list, use_msc, rank, write_buckets, global_results_queue
        ):
            results: dict[int, Any] | Exception = {}
            local: queue.Queue = queue.Queue()
            for i, bucket in enumerate(write_buckets):
                count: queue.Queue = queue.Queue()
                count.put(i)
                base.write_preloaded_data(
                    transform_list, i, bucket, local, count, True, **({"use_msc": True} if use_msc else {})
                )
                index, written = local.get()
                if isinstance(written, Exception):
                    results = written
                    break
                results[index] = written
            global_results_queue.put(results)

    filesystem_async._get_write_results_queue = queue.Queue
    torch_strategy.FileSystemWriterAsync = InProcessWriter


def refresh_fp8_weight_caches(model: torch.nn.Module) -> int:
    """Make Transformer Engine re-quantize every weight at the next forward (its first micro-batch of
    a step); returns how many modules were told.

    TE caches a linear's FP8 weight across micro-batches when its forward gets
    `is_first_microbatch=False`, and Megatron's TE wrappers pass their `is_first_microbatch`
    attribute, which they set False after each forward; megatron's own schedules set it True again
    at each step's first micro-batch (`set_is_first_microbatch`), this trainer's plain loop must do
    the same. Without it the FP8 forward keeps the weights of the first step while the engine gets
    the updated ones, and the trainer vs engine mismatch grows step after step (seen on the H200,
    docs/benchmarks.md). bf16 modules ignore the flag."""
    told = 0
    for module in model.modules():
        if hasattr(module, "is_first_microbatch"):
            module.is_first_microbatch = True
            told += 1
    return told


def _loopback_env() -> None:
    """Keep gloo's and NCCL's connections between the ranks on loopback (the world is one host)."""
    if sys.platform.startswith("linux"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")


def set_offloaded_adam_steps(optimizer: Any, step: int) -> int:
    """Set the Adam step count of every host-side (offloaded) parameter to `step`, the updates the
    checkpoint's optimizer had made (one per `train_step`); the number of states set.

    megatron-core 0.19.2's HybridDeviceOptimizer (`trainer.optimizer.cpu_offload`) restores the
    master weights and both moments of a checkpoint exactly, but the update after a load differed
    from the uninterrupted one in the master weights only (up to 1e-5 at lr 1e-4, moments equal:
    measured on the H200, tests/gpu/test_megatron_optimizer.py), the signature of a wrong bias
    correction, i.e. torch AdamW's per-parameter `step`. The GPU optimizers keep the step in their
    param groups, which megatron-core restores; nothing to do there."""
    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

    count = 0
    for chained in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(chained, "optimizer", None)
        if not isinstance(inner, HybridDeviceOptimizer):
            continue
        for sub in inner.sub_optimizers:
            for state in sub.state.values():
                if isinstance(state.get("step"), Tensor):
                    state["step"] = torch.full_like(state["step"], float(step))
                    count += 1
        for state in inner.state.values():
            if isinstance(state.get("step"), Tensor):
                state["step"] = torch.full_like(state["step"], float(step))
    return count


class MegatronTrainer:
    """One rank: its model shards, DDP buffers and optimizer shard; `train_step`, export, checkpoints."""

    def __init__(
        self,
        *,
        model_cfg: ModelConfig,
        precision_cfg: PrecisionConfig,
        trainer_cfg: TrainerConfig,
        algorithm_cfg: AlgorithmConfig,
        parallel_cfg: ParallelConfig,
        checkpoint_path: str,
        load_path: str | None,
        ref_load: str | None,
        device: str,
        seed: int,
        temperature: float,
        rank: int,
        world_size: int,
        store: dist.Store,
        timeout_s: float,
    ) -> None:
        """`parallel_cfg` has its dp resolved (tp * pp * cp * dp = world_size). `store` is rank 0's
        rendezvous store (rank 0 holds it; the others are connected to it). `load_path`: a Megatron
        checkpoint directory (`checkpoint.load`) the weights boot from instead of `checkpoint_path`
        (HF); `ref_load`: the HF checkpoint of the KL reference (`checkpoint.ref_load`; None: the
        starting policy). `timeout_s` bounds every collective of this world."""
        from skyq.trainer.megatron import te_env

        # before the first megatron import: it imports Transformer Engine, which reads this env then
        te_vars = te_env.apply(precision_cfg, torch.device(device))
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        from skyq.trainer.megatron import cpu_compat
        from skyq.trainer.megatron.mapping import load_hf_checkpoint
        from skyq.trainer.megatron.model import build_model

        cpu_compat.apply()
        optimizer_cpu_compat()
        if temperature <= 0:
            raise ValueError(f"rollout.temperature={temperature}: the trainer scores sampled policies (> 0)")
        check_supported(parallel_cfg=parallel_cfg, optimizer_cfg=trainer_cfg.optimizer, device=device)
        self.model_cfg, self.precision_cfg, self.trainer_cfg = model_cfg, precision_cfg, trainer_cfg
        self.algorithm_cfg, self.parallel_cfg = algorithm_cfg, parallel_cfg
        self.optimizer_cfg = trainer_cfg.optimizer
        self.micro_batch_size = trainer_cfg.micro_batch_size
        self.temperature = temperature
        self.device = torch.device(device)
        self.rank, self.world_size = rank, world_size
        self.spec = "te" if self.device.type == "cuda" else "local"
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device.index or 0)  # Ray shows each rank its one GPU as 0
        _loopback_env()
        dist.init_process_group(
            "nccl" if self.device.type == "cuda" else "gloo",
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
        )
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=parallel_cfg.tp,
            pipeline_model_parallel_size=parallel_cfg.pp,
            context_parallel_size=parallel_cfg.cp,
            expert_model_parallel_size=parallel_cfg.ep,
            expert_tensor_parallel_size=parallel_cfg.etp,
        )
        model_parallel_cuda_manual_seed(seed)
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.dp_size = parallel_state.get_data_parallel_world_size()
        build = dict(device=device, seed=seed)
        model = build_model(model_cfg, precision_cfg, trainer_cfg, parallel_cfg, **build)
        if load_path is None:
            load_hf_checkpoint(model, checkpoint_path, model_cfg, self.spec)
        else:
            self._load_model_only(model, load_path)
        self.ref_model = None
        if algorithm_cfg.kl_coef > 0:  # the KL reference: frozen, the starting policy unless ref_load
            self.ref_model = build_model(model_cfg, precision_cfg, trainer_cfg, parallel_cfg, **build)
            if ref_load is None:
                self.ref_model.load_state_dict(model.state_dict())
            else:
                load_hf_checkpoint(self.ref_model, ref_load, model_cfg, self.spec)
            self.ref_model = _mixed_precision(self.ref_model).eval().requires_grad_(False)
        elif ref_load is not None:
            raise ValueError(
                f"checkpoint.ref_load={ref_load} is the KL reference, but algorithm.kl_coef=0 uses none; "
                "set algorithm.kl_coef > 0 or checkpoint.ref_load=null"
            )
        te_env.check(te_vars)
        self.model, self.optimizer = self._wrap(model)
        self.step = 0

    def _wrap(self, model: torch.nn.Module) -> tuple[Any, Any]:
        """Megatron DDP (fp32 grad buffers, reduced once per step) and the distributed optimizer."""
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

        model = _mixed_precision(model)
        config = model.config
        # Each share's loss is divided by the whole batch's token count already: DP must sum.
        config.calculate_per_token_loss = True
        ddp = DistributedDataParallel(
            config,
            DistributedDataParallelConfig(
                grad_reduce_in_fp32=True,
                overlap_grad_reduce=False,
                overlap_param_gather=False,
                use_distributed_optimizer=True,
            ),
            model,
        )
        with cuda_type_names():
            optimizer = self._optimizer(ddp, config)
        return ddp, optimizer

    def _optimizer(self, ddp: Any, config: Any) -> Any:
        """Megatron's distributed Adam(W) over `ddp`'s parameters, from trainer.optimizer."""
        from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig
        from megatron.core.optimizer import get_megatron_optimizer

        o = self.optimizer_cfg
        low = torch.bfloat16 if o.precision_aware else torch.float32
        return get_megatron_optimizer(
            MegatronOptimizerConfig(
                optimizer="adam",
                lr=self.algorithm_cfg.lr,
                weight_decay=o.weight_decay,
                adam_beta1=o.adam_beta1,
                adam_beta2=o.adam_beta2,
                adam_eps=o.adam_eps,
                clip_grad=o.grad_clip,
                bf16=config.bf16,
                fp16=config.fp16,
                params_dtype=config.params_dtype,
                use_distributed_optimizer=True,
                optimizer_cpu_offload=o.cpu_offload,
                optimizer_offload_fraction=1.0 if o.cpu_offload else 0.0,
                overlap_cpu_optimizer_d2h_h2d=o.overlap_cpu_offload,
                use_precision_aware_optimizer=o.precision_aware,
                exp_avg_dtype=low,
                exp_avg_sq_dtype=low,
            ),
            [ddp],
        )

    # compute ------------------------------------------------------------------------------------

    def token_logprobs(self, logits: Tensor, input_ids: Tensor) -> Tensor:
        """[B, T] fp32 log-prob of token t given tokens < t (0 at t = 0), at the sampling temperature,
        from the model's [B, T, V / tp] logits: `skyq.trainer.native.trainer.token_logprobs` on
        vocab-parallel logits (TP never gathers the vocabulary)."""
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

        scaled = (logits[:, :-1].float() / self.temperature).transpose(0, 1).contiguous()
        target = input_ids[:, 1:].transpose(0, 1).contiguous()
        logp = -vocab_parallel_cross_entropy(scaled, target).transpose(0, 1)
        return F.pad(logp, (1, 0))

    def _schedule(
        self,
        model: torch.nn.Module,
        share: RolloutBatch,
        *,
        forward_only: bool,
        loss_of: Any = None,
    ) -> Tensor:
        """Run `share`'s micro-batches through megatron's schedule; the [rows, T] token log-probs
        of the share (on every stage of the pipeline: the last stage computes and broadcasts them).

        `loss_of(index, micro, logp)` (with a backward, `forward_only=False`): the micro-batch's
        loss, computed on the last stage. Causal attention without a padding mask: the batch is
        right-padded, so a real token never sees a pad; pad positions get log-probs no loss reads."""
        from megatron.core import parallel_state
        from megatron.core.pipeline_parallel import get_forward_backward_func

        size = self.micro_batch_size
        micros = [share.slice(first, first + size) for first in range(0, len(share), size)]
        rows: list[Tensor] = []

        def forward_step(data_iterator: Iterator, module: torch.nn.Module) -> tuple[Tensor, Any]:
            index, micro = next(data_iterator)
            ids, attn = micro.input_ids.to(self.device), micro.attention_mask.to(self.device)
            output = module(input_ids=ids, position_ids=position_ids_of(attn), attention_mask=None)

            def loss_func(logits: Tensor) -> tuple[Tensor, Tensor, dict]:
                logp = self.token_logprobs(logits, ids)
                rows.append(logp.detach())
                loss = logits.new_zeros(()) if loss_of is None else loss_of(index, micro, logp)
                return loss, torch.ones((), dtype=torch.int, device=logits.device), {}

            return output, loss_func

        get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter(enumerate(micros)),
            model=[model],
            num_microbatches=len(micros),
            seq_length=share.input_ids.shape[1],
            micro_batch_size=size,
            forward_only=forward_only,
        )
        if self.parallel_cfg.pp == 1:
            return torch.cat(rows).cpu()
        if parallel_state.is_pipeline_last_stage():
            logp = torch.cat(rows).contiguous()
        else:
            logp = torch.empty(share.input_ids.shape, dtype=torch.float32, device=self.device)
        dist.broadcast(
            logp,
            parallel_state.get_pipeline_model_parallel_last_rank(),
            group=parallel_state.get_pipeline_model_parallel_group(),
        )
        return logp.cpu()

    def _share(self, batch: RolloutBatch) -> tuple[RolloutBatch, int, int]:
        """This DP rank's rows of `batch` padded to equal shares (and, with sequence parallel, to a
        multiple of tp tokens; under pipeline parallelism to whole micro-batches, the shape every
        stage sends the next): (share, first row, real rows of the share)."""
        columns = batch.input_ids.shape[1]
        if self.parallel_cfg.sequence_parallel:
            columns = _round_up(columns, self.parallel_cfg.tp)
        per_rank = self.micro_batch_size if self.parallel_cfg.pp > 1 else 1
        rows = _round_up(len(batch), self.dp_size * per_rank)
        padded = pad_rows(batch, rows, columns)
        per = rows // self.dp_size
        start = self.dp_rank * per
        return padded.slice(start, start + per), start, max(0, min(per, len(batch) - start))

    @torch.no_grad()
    def logprobs(self, input_ids: Tensor, attention_mask: Tensor) -> dict[str, Any]:
        """This DP rank's share of the [B, T] token log-probs of the current weights (no update):
        {"dp_rank", "start", "logp"}."""
        zeros = torch.zeros(input_ids.shape, dtype=torch.float32)
        batch = RolloutBatch(
            input_ids=input_ids, attention_mask=attention_mask, response_mask=zeros, rollout_logprobs=zeros,
            advantages=zeros[:, 0], rewards=zeros[:, 0],
        )  # fmt: skip
        share, start, real = self._share(batch)
        self.model.eval()
        refresh_fp8_weight_caches(self.model)
        logp = self._schedule(self.model, share, forward_only=True)
        return {"dp_rank": self.dp_rank, "start": start, "logp": logp[:real, : input_ids.shape[1]]}

    def train_step(self, batch: RolloutBatch) -> dict[str, Any]:
        """This rank's part of one GRPO update on `batch` (the whole batch; this rank takes its DP
        share). Returns {"dp_rank", "start", "logp", "ref_logp", "grad_norm", "lr", "step"}: the
        log-probs of its share's real rows (every rank of one DP share returns the same), for the
        worker to assemble the batch's metrics."""
        from megatron.core.distributed import finalize_model_grads

        num_tokens = float(batch.response_mask.sum())
        if num_tokens == 0:
            raise ValueError("train_step got a batch with no response tokens (response_mask is all zero)")
        share, start, real = self._share(batch)
        self.model.train()
        refresh_fp8_weight_caches(self.model)
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        ref = None
        if self.ref_model is not None:
            with torch.no_grad():
                ref = self._schedule(self.ref_model, share, forward_only=True)
        size = self.micro_batch_size

        def loss_of(index: int, micro: RolloutBatch, logp: Tensor) -> Tensor:
            ref_logp = None if ref is None else ref[index * size : index * size + len(micro)].to(self.device)
            loss, _ = policy_loss(
                logp, logp.detach(), micro.rollout_logprobs.to(self.device), micro.advantages.to(self.device),
                micro.response_mask.to(self.device), ref_logp=ref_logp, loss_normalizer=num_tokens,
                with_metrics=False, **loss_kwargs(self.algorithm_cfg),
            )  # fmt: skip
            return loss

        logp = self._schedule(self.model, share, forward_only=False, loss_of=loss_of)
        # DP reduction of the grad buffers, sequence-parallel norms across TP, expert-bias updates.
        finalize_model_grads([self.model])
        lr = learning_rate(self.optimizer_cfg, self.algorithm_cfg, self.step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        with cuda_type_names():
            updated, grad_norm, _ = self.optimizer.step()
        if not updated:
            raise RuntimeError(
                f"rank {self.rank}: megatron's optimizer skipped step {self.step} (non-finite gradients)"
            )
        self.step += 1
        columns = batch.input_ids.shape[1]
        return {
            "dp_rank": self.dp_rank, "start": start, "logp": logp[:real, :columns],
            "ref_logp": None if ref is None else ref[:real, :columns],
            "grad_norm": float(grad_norm), "lr": lr, "step": self.step,
        }  # fmt: skip

    # weights ------------------------------------------------------------------------------------

    def hf_weights(self):
        """(HF name, full bf16 tensor) of every checkpoint tensor: `mapping.export_hf`, a collective
        every rank of the world iterates to the end."""
        from skyq.trainer.megatron.mapping import export_hf

        return export_hf(self.model.module, self.model_cfg, self.spec)

    # checkpoints --------------------------------------------------------------------------------

    def _sharded_state(self, *, loading: bool) -> dict[str, Any]:
        model_state = self.model.module.sharded_state_dict()
        return {
            "format": CHECKPOINT_FORMAT,
            "step": self.step,
            "model": model_state,
            "optimizer": self.optimizer.sharded_state_dict(
                model_state, is_loading=loading, metadata=DISTRIB_OPTIM_METADATA
            ),
        }

    def save_checkpoint(self, directory: str) -> None:
        """Write this rank's shards of weights and optimizer state (and, from rank 0, the step) into
        `directory` (created empty by rank 0 before the call): megatron dist-checkpointing, a
        collective of every rank."""
        from megatron.core import dist_checkpointing

        in_process_checkpoint_writes()
        dist_checkpointing.save(self._sharded_state(loading=False), directory)
        dist.barrier()

    def load_checkpoint(self, directory: str) -> int:
        """Restore weights, optimizer state and step from `save_checkpoint`'s directory; the step."""
        from megatron.core import dist_checkpointing

        for optimizer in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            if not optimizer.optimizer.state:
                # A fresh optimizer (a resume before any step) has no Adam state for the checkpoint's
                # to load into, and 0.16.1's state_dict reads each parameter's step: megatron's own
                # zero-gradient step creates it (every value is then replaced by the checkpoint's).
                optimizer._init_optimizer_states_with_dummy_values()
        loaded = dist_checkpointing.load(self._sharded_state(loading=True), directory)
        if loaded.get("format") != CHECKPOINT_FORMAT:
            raise ValueError(
                f"{directory}: not a {CHECKPOINT_FORMAT} checkpoint (format {loaded.get('format')!r})"
            )
        with torch.no_grad():  # fp32 parameters are their own main copy: copied into in place
            self.model.module.load_state_dict(loaded["model"])
            self.optimizer.load_state_dict(loaded["optimizer"])
        self.step = int(loaded["step"])
        set_offloaded_adam_steps(self.optimizer, self.step)
        return self.step

    def _load_model_only(self, model: torch.nn.Module, directory: str) -> None:
        """`checkpoint.load`: the weights of a Megatron dist checkpoint (its `model` part; the
        optimizer and step of that run are not taken: this run starts at step 0 from them)."""
        from megatron.core import dist_checkpointing

        if not Path(directory).is_dir():
            raise ValueError(
                f"checkpoint.load={directory}: not a directory; point it at a Megatron dist checkpoint "
                "(a skyq run's step_*/trainer.megatron)"
            )
        loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, directory)
        model.load_state_dict(loaded["model"])

    def close(self) -> None:
        """Leave the world (its process groups); the rank's process can go."""
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()
