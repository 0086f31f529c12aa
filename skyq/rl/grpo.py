"""GRPO: group-relative advantages, the clipped policy loss with train/rollout IS correction, and
train/rollout mismatch metrics.

Conventions: per-token tensors are [B, T] aligned with the tokens (`logp[b, t]` is the log-prob of
token t given tokens < t); `mask` is 1 on the response tokens that count. Losses are token-level
means (DAPO): every response token weighs the same, whatever its sequence's length.
"""

from __future__ import annotations

import torch
from torch import Tensor

from skyq.config.enums import ISCorrection


def group_advantages(rewards: Tensor, group_size: int, normalize_std: bool, eps: float = 1e-6) -> Tensor:
    """Advantage of each response: its reward minus its group's mean, over the group's std if asked.

    `rewards` [B] holds groups of `group_size` consecutive responses to one prompt. The std is the
    unbiased one (as DeepSeekMath's GRPO); a group whose rewards are all equal gets advantage 0.
    """
    if rewards.ndim != 1 or rewards.numel() % group_size:
        raise ValueError(
            f"rewards of shape {tuple(rewards.shape)} do not split into groups of group_size={group_size}"
        )
    grouped = rewards.float().view(-1, group_size)
    centered = grouped - grouped.mean(dim=1, keepdim=True)
    if normalize_std and group_size > 1:
        centered = centered / (grouped.std(dim=1, keepdim=True) + eps)
    return centered.reshape(-1)


def masked_mean(values: Tensor, mask: Tensor, normalizer: float | Tensor | None = None) -> Tensor:
    """Sum of `values` over `mask`, divided by `normalizer` (default: the number of masked tokens)."""
    total = (values * mask).sum()
    denominator = mask.sum() if normalizer is None else normalizer
    return total / torch.clamp(torch.as_tensor(denominator, dtype=total.dtype), min=1.0)


def importance_weights(
    old_logp: Tensor,
    rollout_logp: Tensor,
    *,
    is_correction: ISCorrection,
    is_cap: float,
    is_low: float,
    is_high: float,
) -> Tensor:
    """Per-token weight correcting for sampling from the rollout engine rather than the trainer.

    The ratio is pi_train(old) / pi_rollout, detached (it corrects the sampling distribution, it is
    not optimized). tis: min(ratio, cap). icepop (Ring-1T's IcePop): ratio inside [low, high],
    0 outside — tokens whose two probabilities disagree too much carry no gradient.
    """
    ratio = torch.exp(old_logp.detach() - rollout_logp.detach())
    kind = ISCorrection(is_correction)
    if kind is ISCorrection.none:
        return torch.ones_like(ratio)
    if kind is ISCorrection.tis:
        return torch.clamp(ratio, max=is_cap)
    inside = (ratio >= is_low) & (ratio <= is_high)
    return torch.where(inside, ratio, torch.zeros_like(ratio))


def policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    rollout_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_eps_low: float,
    clip_eps_high: float,
    is_correction: ISCorrection,
    is_cap: float,
    is_low: float,
    is_high: float,
    kl_coef: float,
    ref_logp: Tensor | None = None,
    loss_normalizer: float | None = None,
    with_metrics: bool = True,
) -> tuple[Tensor, dict[str, float]]:
    """Clipped PPO objective (asymmetric clip, DAPO's clip-higher) with IS correction and k3 KL.

    `advantages` is [B] (one per sequence) or [B, T]. `loss_normalizer` is the token count the mean
    divides by (the whole batch's, when this call sees one micro-batch of it); default mask.sum().
    Returns the loss and float metrics (means over the masked tokens of this call); without
    `with_metrics` the metrics are {} and nothing is read back to the host (a micro-batch's loss).
    """
    mask = mask.to(logp.dtype)
    adv = advantages[:, None] if advantages.ndim == 1 else advantages
    adv = adv.to(logp.dtype)
    ratio = torch.exp(logp - old_logp.detach())
    clipped_ratio = torch.clamp(ratio, 1.0 - clip_eps_low, 1.0 + clip_eps_high)
    unclipped_loss, clipped_loss = -adv * ratio, -adv * clipped_ratio
    token_loss = torch.maximum(unclipped_loss, clipped_loss)
    weights = importance_weights(
        old_logp, rollout_logp, is_correction=is_correction, is_cap=is_cap, is_low=is_low, is_high=is_high
    )
    pg_loss = masked_mean(token_loss * weights, mask, loss_normalizer)
    loss = pg_loss
    if kl_coef > 0:
        if ref_logp is None:
            raise ValueError("algorithm.kl_coef > 0 needs ref_logp (log-probs of the reference model)")
        log_ratio = ref_logp.detach() - logp
        kl = masked_mean(torch.exp(log_ratio) - log_ratio - 1.0, mask, loss_normalizer)
        loss = loss + kl_coef * kl
    if not with_metrics:
        return loss, {}
    with torch.no_grad():
        raw_ratio = torch.exp(old_logp - rollout_logp)
        metrics = {
            "pg_loss": float(pg_loss.detach()),
            "clip_frac": float(masked_mean((clipped_loss > unclipped_loss).to(mask.dtype), mask)),
            "ratio_mean": float(masked_mean(ratio, mask)),
            "is_weight_mean": float(masked_mean(weights, mask)),
            "is_ratio_max": float((raw_ratio * mask).max()) if mask.any() else 1.0,
            "is_truncated_frac": float(masked_mean((raw_ratio > is_cap).to(mask.dtype), mask))
            if ISCorrection(is_correction) is ISCorrection.tis
            else 0.0,
            "is_masked_frac": float(masked_mean((weights == 0).to(mask.dtype), mask)),
        }
    if kl_coef > 0:
        metrics["kl"] = float(kl.detach())
    metrics["loss"] = float(loss.detach())
    return loss, metrics


@torch.no_grad()
def mismatch_metrics(train_logp: Tensor, rollout_logp: Tensor, mask: Tensor) -> dict[str, float]:
    """How far the rollout engine's token log-probs are from the trainer's on the sampled tokens.

    mismatch_k3 estimates KL(rollout || train) from rollout samples: r - 1 - log r with
    r = pi_train / pi_rollout.
    """
    mask = mask.to(torch.float32)
    diff = (train_logp.float() - rollout_logp.float()) * mask
    k3 = torch.exp(diff) - 1.0 - diff
    return {
        "mismatch_mean_abs": float(masked_mean(diff.abs(), mask)),
        "mismatch_k3": float(masked_mean(k3, mask)),
        "mismatch_max": float(diff.abs().max()) if mask.any() else 0.0,
    }
