"""GRPO math against hand computations."""

from __future__ import annotations

import math

import pytest
import torch

from skyq.config.enums import ISCorrection
from skyq.rl.grpo import group_advantages, importance_weights, mismatch_metrics, policy_loss

LOSS_KW = dict(clip_eps_low=0.2, clip_eps_high=0.28, is_cap=2.0, is_low=0.5, is_high=2.0, kl_coef=0.0)


def test_group_advantages_center_and_scale_per_group():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    adv = group_advantages(rewards, group_size=4, normalize_std=True)
    std = math.sqrt((0.75**2 + 3 * 0.25**2) / 3)  # unbiased std of [1, 0, 0, 0]
    expected_first = [0.75 / (std + 1e-6)] + [-0.25 / (std + 1e-6)] * 3
    assert torch.allclose(adv[:4], torch.tensor(expected_first), atol=1e-6)
    assert torch.equal(adv[4:], torch.zeros(4))  # all-equal group: no signal


def test_group_advantages_without_std_are_centered_rewards():
    adv = group_advantages(torch.tensor([3.0, 1.0, 2.0, 2.0]), group_size=2, normalize_std=False)
    assert torch.equal(adv, torch.tensor([1.0, -1.0, 0.0, 0.0]))


def test_group_advantages_refuse_ragged_groups():
    with pytest.raises(ValueError, match="group_size=3"):
        group_advantages(torch.zeros(8), group_size=3, normalize_std=True)


def test_policy_loss_on_policy_is_minus_mean_advantage():
    logp = torch.log(torch.tensor([[0.5, 0.25, 0.1]])).requires_grad_()
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    adv = torch.tensor([2.0])
    loss, metrics = policy_loss(
        logp, logp.detach(), logp.detach(), adv, mask, is_correction=ISCorrection.none, **LOSS_KW
    )
    assert loss.item() == pytest.approx(-2.0)
    loss.backward()
    # d/dlogp of -A * exp(logp - old) at logp == old is -A per token, over 2 tokens
    assert torch.allclose(logp.grad, torch.tensor([[-1.0, -1.0, 0.0]]))
    assert metrics["clip_frac"] == 0.0


def test_policy_loss_clips_asymmetrically():
    old = torch.zeros(1, 2)
    logp = torch.log(torch.tensor([[1.5, 0.5]])).requires_grad_()  # ratios 1.5 and 0.5
    mask = torch.ones(1, 2)
    kw = dict(LOSS_KW, is_correction=ISCorrection.none)
    loss_pos, m_pos = policy_loss(logp, old, old, torch.tensor([1.0]), mask, **kw)
    # A > 0: ratio 1.5 clipped to 1.28; ratio 0.5 not clipped (min of the two objectives)
    assert loss_pos.item() == pytest.approx(-(1.28 + 0.5) / 2, rel=1e-6)
    assert m_pos["clip_frac"] == 0.5
    loss_neg, m_neg = policy_loss(logp, old, old, torch.tensor([-1.0]), mask, **kw)
    # A < 0: ratio 0.5 clipped to 0.8; ratio 1.5 kept
    assert loss_neg.item() == pytest.approx((1.5 + 0.8) / 2, rel=1e-6)
    assert m_neg["clip_frac"] == 0.5


def test_tis_weights_are_capped_and_detached():
    old = torch.log(torch.tensor([[0.9, 0.5, 0.1]]))
    rollout = torch.log(torch.tensor([[0.3, 0.5, 0.2]]))  # ratios 3, 1, 0.5
    w = importance_weights(old, rollout, is_correction=ISCorrection.tis, is_cap=2.0, is_low=0.5, is_high=2.0)
    assert torch.allclose(w, torch.tensor([[2.0, 1.0, 0.5]]))
    logp = old.clone().requires_grad_()
    loss, metrics = policy_loss(
        logp, old, rollout, torch.tensor([1.0]), torch.ones(1, 3), is_correction=ISCorrection.tis, **LOSS_KW
    )
    assert loss.item() == pytest.approx(-(2.0 + 1.0 + 0.5) / 3, rel=1e-6)
    loss.backward()
    assert torch.allclose(logp.grad, -torch.tensor([[2.0, 1.0, 0.5]]) / 3)
    assert metrics["is_truncated_frac"] == pytest.approx(1 / 3)


def test_icepop_masks_tokens_outside_the_band():
    old = torch.log(torch.tensor([[0.9, 0.5, 0.1, 0.4]]))
    rollout = torch.log(torch.tensor([[0.3, 0.5, 0.4, 0.5]]))  # ratios 3, 1, 0.25, 0.8
    w = importance_weights(
        old, rollout, is_correction=ISCorrection.icepop, is_cap=2.0, is_low=0.5, is_high=2.0
    )
    assert torch.allclose(w, torch.tensor([[0.0, 1.0, 0.0, 0.8]]))
    logp = old.clone().requires_grad_()
    loss, metrics = policy_loss(
        logp,
        old,
        rollout,
        torch.tensor([1.0]),
        torch.ones(1, 4),
        is_correction=ISCorrection.icepop,
        **LOSS_KW,
    )
    loss.backward()
    assert logp.grad[0, 0] == 0 and logp.grad[0, 2] == 0
    assert metrics["is_masked_frac"] == 0.5


def test_k3_kl_term_matches_hand_value():
    logp = torch.log(torch.tensor([[0.5]])).requires_grad_()
    ref = torch.log(torch.tensor([[0.25]]))
    kw = dict(LOSS_KW, kl_coef=0.1)
    loss, metrics = policy_loss(
        logp, logp.detach(), logp.detach(), torch.tensor([0.0]), torch.ones(1, 1),
        is_correction=ISCorrection.none, ref_logp=ref, **{k: v for k, v in kw.items()},
    )  # fmt: skip
    log_ratio = math.log(0.5)  # ref - logp
    expected_kl = math.exp(log_ratio) - log_ratio - 1
    assert metrics["kl"] == pytest.approx(expected_kl, rel=1e-6)
    assert loss.item() == pytest.approx(0.1 * expected_kl, rel=1e-6)
    with pytest.raises(ValueError, match="ref_logp"):
        policy_loss(
            logp, logp, logp, torch.tensor([0.0]), torch.ones(1, 1), is_correction=ISCorrection.none, **kw
        )


def test_loss_normalizer_makes_micro_batches_sum_to_the_full_batch_loss():
    gen = torch.Generator().manual_seed(0)
    logp = -torch.rand(4, 5, generator=gen)
    rollout = logp - 0.1 * torch.rand(4, 5, generator=gen)
    mask = (torch.rand(4, 5, generator=gen) > 0.3).float()
    adv = torch.randn(4, generator=gen)
    kw = dict(LOSS_KW, is_correction=ISCorrection.tis)
    full, _ = policy_loss(logp, logp, rollout, adv, mask, **kw)
    parts = [
        policy_loss(logp[i : i + 2], logp[i : i + 2], rollout[i : i + 2], adv[i : i + 2], mask[i : i + 2],
                    loss_normalizer=float(mask.sum()), **kw)[0]
        for i in (0, 2)
    ]  # fmt: skip
    assert torch.allclose(full, parts[0] + parts[1])


def test_mismatch_metrics_hand_values():
    train = torch.tensor([[0.0, -1.0, -2.0]])
    rollout = torch.tensor([[5.0, -1.5, -1.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0]])
    m = mismatch_metrics(train, rollout, mask)
    assert m["mismatch_mean_abs"] == pytest.approx(0.75)
    assert m["mismatch_max"] == pytest.approx(1.0)
    k3 = [math.exp(0.5) - 1 - 0.5, math.exp(-1.0) - 1 + 1.0]
    assert m["mismatch_k3"] == pytest.approx(sum(k3) / 2)
