"""Temperature / top-p sampling by inverting the cumulative distribution, and the log-probs it reports."""

from __future__ import annotations

import pytest
import torch

from skyq.rollout.sampling import draw_uniforms, sample_tokens


def _u(rows: int, seed: int = 0) -> torch.Tensor:
    return draw_uniforms(torch.Generator().manual_seed(seed), 1, rows)[0]


def test_top_p_never_samples_outside_the_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(2000, 1)
    tokens, logprobs = sample_tokens(logits, temperature=1.0, top_p=0.7, uniforms=_u(2000))
    assert set(tokens.tolist()) == {0, 1}  # 0.5 + 0.3 reaches 0.7; tokens 2 and 3 are cut
    assert abs(float((tokens == 0).float().mean()) - 0.5 / 0.8) < 0.05
    # reported log-probs are those of the temperature-scaled distribution before truncation
    torch.testing.assert_close(logprobs[tokens == 1][0], torch.log(torch.tensor(0.3)))


def test_the_draw_inverts_the_cumulative_distribution():
    """u below the first token's mass picks it, u past it the next; a uniform at the top of [0, 1)
    never reaches a token the nucleus cut (nor a zero-probability one past the end)."""
    logits = torch.log(torch.tensor([[0.25, 0.25, 0.5, 0.0]]))
    u = torch.tensor([0.0, 0.2499, 0.2501, 0.5001, 1.0 - 2**-53], dtype=torch.float64)
    tokens, _ = sample_tokens(logits.repeat(5, 1), temperature=1.0, top_p=1.0, uniforms=u)
    assert tokens.tolist() == [0, 0, 1, 2, 2]
    cut, _ = sample_tokens(logits.repeat(5, 1), temperature=1.0, top_p=0.5, uniforms=u)
    assert cut.tolist() == [2, 2, 2, 2, 2]  # the nucleus is token 2 alone


def test_frequencies_follow_the_distribution_and_the_seed_fixes_the_draw():
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    logits = torch.log(probs).repeat(20000, 1)
    tokens, _ = sample_tokens(logits, temperature=1.0, top_p=1.0, uniforms=_u(20000, seed=3))
    freq = torch.bincount(tokens, minlength=4).float() / 20000
    assert torch.allclose(freq, probs, atol=0.015)
    again, _ = sample_tokens(logits, temperature=1.0, top_p=1.0, uniforms=_u(20000, seed=3))
    assert torch.equal(tokens, again)
    other, _ = sample_tokens(logits, temperature=1.0, top_p=1.0, uniforms=_u(20000, seed=4))
    assert not torch.equal(tokens, other)


def test_temperature_scales_the_distribution_and_zero_is_greedy():
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    tokens, logprobs = sample_tokens(logits, temperature=0.0, top_p=1.0, uniforms=_u(1))
    assert tokens.tolist() == [0]
    torch.testing.assert_close(logprobs, torch.log_softmax(logits, -1)[:, 0])
    tokens, logprobs = sample_tokens(logits.repeat(4, 1), temperature=2.0, top_p=1.0, uniforms=_u(4, seed=1))
    expected = torch.log_softmax(logits / 2.0, -1)[0, tokens]
    torch.testing.assert_close(logprobs, expected)


@pytest.mark.parametrize(("temperature", "top_p", "key"), [(-1.0, 1.0, "temperature"), (1.0, 0.0, "top_p")])
def test_invalid_sampling_arguments_are_refused(temperature, top_p, key):
    with pytest.raises(ValueError, match=f"rollout.{key}"):
        sample_tokens(torch.zeros(1, 3), temperature=temperature, top_p=top_p, uniforms=_u(1))
