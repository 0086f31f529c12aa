"""Temperature / top-p sampling and the log-probs it reports."""

from __future__ import annotations

import pytest
import torch

from skyq.rollout.sampling import sample_tokens


def test_top_p_never_samples_outside_the_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(2000, 1)
    tokens, logprobs = sample_tokens(
        logits, temperature=1.0, top_p=0.7, generator=torch.Generator().manual_seed(0)
    )
    assert set(tokens.tolist()) == {0, 1}  # 0.5 + 0.3 reaches 0.7; tokens 2 and 3 are cut
    assert abs(float((tokens == 0).float().mean()) - 0.5 / 0.8) < 0.05
    # reported log-probs are those of the temperature-scaled distribution before truncation
    torch.testing.assert_close(logprobs[tokens == 1][0], torch.log(torch.tensor(0.3)))


def test_temperature_scales_the_distribution_and_zero_is_greedy():
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    tokens, logprobs = sample_tokens(logits, temperature=0.0, top_p=1.0, generator=torch.Generator())
    assert tokens.tolist() == [0]
    torch.testing.assert_close(logprobs, torch.log_softmax(logits, -1)[:, 0])
    gen = torch.Generator().manual_seed(1)
    tokens, logprobs = sample_tokens(logits.repeat(4, 1), temperature=2.0, top_p=1.0, generator=gen)
    expected = torch.log_softmax(logits / 2.0, -1)[0, tokens]
    torch.testing.assert_close(logprobs, expected)


@pytest.mark.parametrize(("temperature", "top_p", "key"), [(-1.0, 1.0, "temperature"), (1.0, 0.0, "top_p")])
def test_invalid_sampling_arguments_are_refused(temperature, top_p, key):
    with pytest.raises(ValueError, match=f"rollout.{key}"):
        sample_tokens(torch.zeros(1, 3), temperature=temperature, top_p=top_p, generator=torch.Generator())
