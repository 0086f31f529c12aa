"""NativeTrainer: GRPO updates of a transformers MoE model (Qwen3-MoE, DeepSeek-V3, and Kimi-K2.6's vision
tower and projector beside DeepSeek-V3: a batch's images are scored with their rows) in plain PyTorch.

fp32 master weights and AdamW state; the forward computes on the weights the rollout engine holds
(bf16, fake-quantized where the precision's strategy quantizes — see precision.py). One optimizer
step per `train_step`, gradients accumulated over micro-batches of the rollout batch.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from skyq.config.enums import ComputeDtype, Fp8Gemm, ISCorrection
from skyq.config.schema import AlgorithmConfig, ModelConfig, OptimizerConfig, PrecisionConfig
from skyq.ops.grouped_mm import bf16_grouped_mm_on
from skyq.quant.kernels import dispatch
from skyq.quant.layouts import experts as expert_layout
from skyq.quant.layouts import get_layout
from skyq.quant.strategies import get_strategy
from skyq.rl.batch import PromptImages, RolloutBatch
from skyq.rl.grpo import mismatch_metrics, policy_loss
from skyq.sync.sender import WeightItem
from skyq.trainer.native.model import fp32_parameters, hf_dtype, hf_state, load_model, write_hf_checkpoint
from skyq.trainer.native.precision import effective_parameters, quantize_activations, route_experts


def resolve_fp8_gemm(mode: Fp8Gemm, device: torch.device) -> bool | None:
    """`trainer.fp8_gemm` on this device: None = fake quant, False = cuBLAS, True = emulated."""
    if mode is Fp8Gemm.off:
        return None
    if mode is Fp8Gemm.emulated:
        return True
    from skyq.trainer.fp8_linear import blockwise_gemm_supported

    return False if blockwise_gemm_supported(device) else None


class TrainerStateError(ValueError):
    """A trainer state dict that does not fit this trainer (other model, missing entries)."""


def position_ids_of(attention_mask: Tensor) -> Tensor:
    """Positions counting real tokens only, so left or right padding gives the same positions."""
    return (attention_mask.long().cumsum(dim=-1) - 1).clamp(min=0)


def token_logprobs(
    forward: Callable[..., Any],
    input_ids: Tensor,
    attention_mask: Tensor,
    *,
    temperature: float = 1.0,
    images: list[PromptImages | None] | None = None,
) -> Tensor:
    """[B, T] log-prob of token t given tokens < t (0 at t = 0), in fp32; `forward` is the model call.

    Scored at the sampling temperature, as the rollout engine reports its log-probs. `images` (one entry
    per row, a multimodal batch only) go to the model, which puts them in place of their placeholders.
    """
    extra = {} if images is None else {"images": images}
    logits = forward(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_of(attention_mask),
        **extra,
    ).logits
    logp = (
        torch.log_softmax(logits[:, :-1].float() / temperature, dim=-1)
        .gather(-1, input_ids[:, 1:, None])
        .squeeze(-1)
    )
    return F.pad(logp, (1, 0))


class NativeTrainer:
    """GRPO trainer over a transformers model, computing on the weights the engines serve.

    Precision: every forward runs on `effective_parameters()` (bf16-rounded master weights,
    fake-quantized by the strategy where it quantizes them) and, for the FP8 recipes, on
    fake-quantized inputs of the quantized linears (module rewrite, see precision.py).
    `seed` is recorded with the run; the update itself draws no random numbers (no dropout).
    The KL reference (kl_coef > 0) is the policy loaded from `checkpoint_path`, frozen.
    """

    def __init__(
        self,
        *,
        model_cfg: ModelConfig,
        precision_cfg: PrecisionConfig,
        optimizer_cfg: OptimizerConfig,
        algorithm_cfg: AlgorithmConfig,
        micro_batch_size: int,
        checkpoint_path: str,
        device: str = "cpu",
        seed: int,
        temperature: float = 1.0,
        fp8_gemm: Fp8Gemm = Fp8Gemm.off,
        compute_dtype: ComputeDtype = ComputeDtype.fp32,
    ) -> None:
        """`temperature`: the rollout sampling temperature; log-probs are scored at it (the policy
        the engine actually sampled from), so ratios and mismatch compare like with like.
        `fp8_gemm`: `trainer.fp8_gemm` (FP8 blockwise linears as FP8 GEMMs; see precision.py).
        `compute_dtype`: `trainer.compute_dtype`; bf16 runs every forward/backward on the effective
        weights cast to bf16 (the engine's numerics), the master weights and optimizer stay fp32."""
        if micro_batch_size <= 0:
            raise ValueError(f"trainer.micro_batch_size={micro_batch_size} must be positive")
        if temperature <= 0:
            raise ValueError(f"rollout.temperature={temperature}: the trainer scores sampled policies (> 0)")
        self.temperature = temperature
        self.model_cfg, self.precision_cfg = model_cfg, precision_cfg
        self.optimizer_cfg, self.algorithm_cfg = optimizer_cfg, algorithm_cfg
        self.micro_batch_size = micro_batch_size
        self.device = torch.device(device)
        self.seed = seed
        self.layout = get_layout(model_cfg.family)
        self.strategy = get_strategy(precision_cfg)
        self.model = load_model(checkpoint_path, model_cfg, dtype=torch.float32).to(self.device)
        self.compute_dtype = (
            torch.bfloat16 if ComputeDtype(compute_dtype) is ComputeDtype.bf16 else torch.float32
        )
        """The dtype of the forward's weights (so of its activations); the master stays fp32."""
        self.fp8_gemm = resolve_fp8_gemm(Fp8Gemm(fp8_gemm), self.device)
        """None: fake quant; False: cuBLAS blockwise FP8 GEMMs; True: their fp32 emulation."""
        self.activation_quantized = quantize_activations(
            self.model, precision_cfg=precision_cfg, quantizes=self._quantizes, fp8_gemm=self.fp8_gemm
        )
        # On a GPU with bf16 grouped GEMMs the engine runs its experts grouped: so do the trainer's
        # (those an activation quantizer did not take already), keeping bf16's log-probs its bits.
        self.routed_experts = (
            route_experts(self.model)
            if self.device.type == "cuda"
            and self.compute_dtype is torch.bfloat16
            and bf16_grouped_mm_on(self.device)
            else []
        )
        self.fp32_names = fp32_parameters(self.model, model_cfg)
        """Parameters the checkpoint and the engine keep in fp32 (the router bias): never cast down."""
        self._check_names_match_layout()
        # The KL reference is the policy the run started from: its effective weights, frozen.
        self.ref_params = (
            {k: v.detach().clone() for k, v in self.effective_parameters().items()}
            if algorithm_cfg.kl_coef > 0
            else None
        )
        # On a GPU the fused kernel: one pass over weights, gradients and moments instead of the
        # ~15 multi-tensor passes of the foreach default, at the end of a step the host then waits for
        # (`benchmarks/train_step.py`; docs/benchmarks.md).
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(),
            lr=algorithm_cfg.lr,
            betas=(optimizer_cfg.adam_beta1, optimizer_cfg.adam_beta2),
            eps=optimizer_cfg.adam_eps,
            weight_decay=optimizer_cfg.weight_decay,
            fused=self.device.type == "cuda",
        )
        self.step = 0

    def _quantizes(self, trainer_name: str, shape: tuple[int, ...]) -> bool:
        role = self.layout.role(trainer_name, self.model_cfg)
        if len(shape) == 3:  # a fused expert stack: quantized iff its role is
            return self.strategy.quantizes(role)
        return self.strategy.quantizes_param(trainer_name, shape, role)

    def _check_names_match_layout(self) -> None:
        expected = {spec.name for spec in self.layout.hf_parameters(self.model_cfg)}
        produced = set(self._hf_tensors())
        if expected != produced:
            raise TrainerStateError(
                f"the model's parameters do not map onto the {self.model_cfg.family.value} layout: "
                f"missing {sorted(expected - produced)[:5]}, unexpected {sorted(produced - expected)[:5]}"
            )

    # weights ------------------------------------------------------------------------------------

    def _hf_tensors(self) -> dict[str, Tensor]:
        return hf_state(self.model, self.model_cfg)

    def hf_weights(self) -> Iterator[tuple[str, Tensor]]:
        """(HF name, tensor) of every checkpoint tensor, per expert, in the layout's order.

        These are the master weights rounded to their checkpoint dtype (bf16; fp32 for the router
        bias): what the sender serializes for the engines.
        """
        tensors = self._hf_tensors()
        for spec in self.layout.hf_parameters(self.model_cfg):
            yield spec.name, tensors[spec.name].contiguous()

    def hf_weight_items(self) -> Iterator[WeightItem]:
        """The same tensors as `hf_weights()`, routed experts held together: `(HF name, tensor)` for
        every other parameter and `(HF names, stack)` per projection of each fused experts tensor,
        where `stack[e]` is expert e's tensor (gate and up rows as separate stacks).

        A quantizer then takes one projection's experts in one call (the sender's stacked items);
        the values are exactly those `hf_weights()` yields. Order: the layout's, a stack where
        its first expert would be.
        """
        items: dict[str, WeightItem] = {}  # keyed by the item's first HF name
        for trainer_name, param in self.model.named_parameters():
            tensor = param.detach().to(hf_dtype(self.layout, trainer_name, self.model_cfg))
            fused = expert_layout.parse_fused_name(trainer_name)
            if fused is None:
                (hf_name,) = self.layout.trainer_to_hf_names(trainer_name, self.model_cfg)
                items[hf_name] = (hf_name, tensor.contiguous())
                continue
            module = self.model_cfg.text_prefix + fused[0]
            for projection, stack in expert_layout.projection_stacks(trainer_name, tensor, self.model_cfg):
                names = tuple(f"{module}.{e}.{projection}.weight" for e in range(stack.shape[0]))
                items[names[0]] = (names, stack.contiguous())
        for spec in self.layout.hf_parameters(self.model_cfg):
            if spec.name in items:
                yield items.pop(spec.name)
        assert not items, f"trainer tensors outside the layout: {sorted(items)[:5]}"

    def save_hf(self, directory: str | Path) -> Path:
        """Write the current weights as a bf16 HF safetensors checkpoint."""
        return write_hf_checkpoint(directory, dict(self.hf_weights()), self.model_cfg)

    def effective_parameters(self) -> dict[str, Tensor]:
        """{trainer name: the value the forward computes with} (differentiable w.r.t. the master)."""
        return effective_parameters(
            dict(self.model.named_parameters()),
            strategy=self.strategy,
            layout=self.layout,
            model_cfg=self.model_cfg,
            dtype=self.compute_dtype,
        )

    # compute ------------------------------------------------------------------------------------

    def _forward(self, params: dict[str, Tensor]) -> Callable[..., Any]:
        """The model call on `params`, cast to the compute dtype (differentiable: the gradient
        reaches the fp32 master through the cast). Effective weights are bf16 values already, so
        the bf16 cast is exact and the forward sees exactly the weights the engine holds."""
        if self.compute_dtype != torch.float32:
            params = {
                name: value if name in self.fp32_names else value.to(self.compute_dtype)
                for name, value in params.items()
            }
        return lambda **kwargs: torch.func.functional_call(self.model, params, args=(), kwargs=kwargs)

    @torch.no_grad()
    def logprobs(
        self, input_ids: Tensor, attention_mask: Tensor, images: list[PromptImages | None] | None = None
    ) -> Tensor:
        """[B, T] fp32 log-prob of each token given the ones before it (0 at position 0) and the rows'
        `images` (a multimodal batch)."""
        self.model.eval()
        forward = self._forward(self.effective_parameters())
        rows = []
        with dispatch.deferred_finite_checks():  # one host read for all the quantizers' finite checks
            for start in range(0, input_ids.shape[0], self.micro_batch_size):
                stop = start + self.micro_batch_size
                ids, attn = input_ids[start:stop].to(self.device), attention_mask[start:stop].to(self.device)
                micro_images = None if images is None else images[start:stop]
                rows.append(
                    token_logprobs(forward, ids, attn, temperature=self.temperature, images=micro_images)
                )
        return torch.cat(rows).cpu()

    def learning_rate(self, step: int) -> float:
        """Linear warm-up over optimizer.lr_warmup_steps, then constant algorithm.lr."""
        warmup = self.optimizer_cfg.lr_warmup_steps
        scale = min(1.0, (step + 1) / warmup) if warmup > 0 else 1.0
        return self.algorithm_cfg.lr * scale

    def _loss_kwargs(self) -> dict[str, Any]:
        a = self.algorithm_cfg
        return {
            "clip_eps_low": a.clip_eps_low, "clip_eps_high": a.clip_eps_high,
            "is_correction": ISCorrection(a.is_correction), "is_cap": a.is_cap, "is_low": a.is_low,
            "is_high": a.is_high, "kl_coef": a.kl_coef,
        }  # fmt: skip

    def _accumulate_gradients(
        self, batch: RolloutBatch, num_tokens: float, old_rows: list[Tensor], ref_rows: list[Tensor]
    ) -> None:
        """Forward + backward of every micro-batch of `batch`; appends their log-probs (on the
        device) to the lists.

        The effective weights (bf16 rounding and fake quant of every master weight, in the compute
        dtype) are computed once for the step. One micro-batch backpropagates through them to the
        master. Several read them as detached leaves: each micro-batch's gradients are summed in the
        master's dtype (fp32), and the sums become the master's gradients, as the straight-through
        estimator passes them (`precision._StraightThrough`). Bit for bit the gradients of a
        backward per micro-batch through freshly quantized weights (the same fp32 sums in the same
        order), without quantizing every weight again per micro-batch."""
        starts = range(0, len(batch), self.micro_batch_size)
        several = len(starts) > 1
        masters = dict(self.model.named_parameters())
        names = [name for name, master in masters.items() if master.requires_grad]
        with torch.set_grad_enabled(not several):  # several: no graph to the masters (set below)
            effective = self.effective_parameters()
        leaves = effective
        if several:
            leaves = {
                name: value.requires_grad_(masters[name].requires_grad) for name, value in effective.items()
            }
        sums: list[Tensor | None] = [None] * len(names)
        forward = self._forward(leaves)
        for start in starts:
            micro = batch.slice(start, start + self.micro_batch_size)
            ids, attn = micro.input_ids.to(self.device), micro.attention_mask.to(self.device)
            logp = token_logprobs(forward, ids, attn, temperature=self.temperature, images=micro.images)
            ref_logp = None
            if self.ref_params is not None:
                with torch.no_grad():
                    ref_logp = token_logprobs(
                        self._forward(self.ref_params),
                        ids,
                        attn,
                        temperature=self.temperature,
                        images=micro.images,
                    )
                ref_rows.append(ref_logp)
            loss, _ = policy_loss(
                logp, logp.detach(), micro.rollout_logprobs.to(self.device), micro.advantages.to(self.device),
                micro.response_mask.to(self.device), ref_logp=ref_logp, loss_normalizer=num_tokens,
                with_metrics=False, **self._loss_kwargs(),
            )  # fmt: skip
            old_rows.append(logp.detach())
            if leaves is effective:
                loss.backward()
                continue
            grads = torch.autograd.grad(loss, [leaves[n] for n in names], allow_unused=True)
            for i, (name, grad) in enumerate(zip(names, grads, strict=True)):
                if grad is None:
                    continue
                if sums[i] is None:
                    sums[i] = grad.to(masters[name].dtype, copy=True)
                else:
                    sums[i].add_(grad)
        for name, total in zip(names, sums, strict=True):
            if total is not None:
                master = masters[name]
                master.grad = total if master.grad is None else master.grad + total

    def train_step(self, batch: RolloutBatch) -> dict[str, float]:
        """One GRPO update on `batch`: accumulate over micro-batches, clip, AdamW step.

        On-policy (one update per rollout batch), so the "old" policy is the current one and the
        PPO ratio is 1; what the IS correction acts on is trainer vs rollout-engine probabilities.
        """
        self.model.train()
        num_tokens = float(batch.response_mask.sum())
        if num_tokens == 0:
            raise ValueError("train_step got a batch with no response tokens (response_mask is all zero)")
        self.optimizer.zero_grad(set_to_none=True)
        old_rows, ref_rows = [], []
        # The quantizers' finite checks are read once, after all backward passes and BEFORE the
        # optimizer step: a non-finite weight or activation still stops the update untouched.
        with dispatch.deferred_finite_checks():
            self._accumulate_gradients(batch, num_tokens, old_rows, ref_rows)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.optimizer_cfg.grad_clip)
        lr = self.learning_rate(self.step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.step += 1
        old_logp = torch.cat(old_rows).cpu()
        _, metrics = policy_loss(
            old_logp, old_logp, batch.rollout_logprobs, batch.advantages, batch.response_mask,
            ref_logp=torch.cat(ref_rows).cpu() if ref_rows else None, **self._loss_kwargs(),
        )  # fmt: skip
        metrics.update(mismatch_metrics(old_logp, batch.rollout_logprobs, batch.response_mask))
        metrics.update(
            grad_norm=float(grad_norm), lr=lr, step=float(self.step), reward_mean=float(batch.rewards.mean()),
            response_tokens_mean=num_tokens / len(batch),
        )  # fmt: skip
        return metrics

    # checkpointing ------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """A snapshot: fp32 master weights (trainer names), AdamW state and the step count.

        Copied, not referenced: `optimizer.state_dict()` returns the live moment tensors, which the
        next step would change under a caller that has not written them out yet.
        """
        return {
            "model": {k: v.detach().clone() for k, v in self.model.state_dict().items()},
            "optimizer": copy.deepcopy(self.optimizer.state_dict()),
            "step": self.step,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned; refuses a state of another model."""
        for key in ("model", "optimizer", "step"):
            if key not in state:
                raise TrainerStateError(f"trainer state has no {key!r} entry (keys: {sorted(state)})")
        own = self.model.state_dict()
        missing, unexpected = sorted(set(own) - set(state["model"])), sorted(set(state["model"]) - set(own))
        if missing or unexpected:
            raise TrainerStateError(
                f"trainer state does not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}"
            )
        for name, tensor in state["model"].items():
            if tuple(tensor.shape) != tuple(own[name].shape):
                raise TrainerStateError(
                    f"trainer state {name}: shape {tuple(tensor.shape)} != model {tuple(own[name].shape)}"
                )
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(copy.deepcopy(state["optimizer"]))  # never alias the caller's tensors
        self.step = int(state["step"])
