"""Token sampling with temperature and nucleus (top-p) truncation, reproducible from a generator."""

from __future__ import annotations

import torch
from torch import Tensor


def check_sampling_args(temperature: float, top_p: float) -> None:
    if temperature < 0:
        raise ValueError(f"rollout.temperature={temperature} must be >= 0 (0 = greedy)")
    if not 0 < top_p <= 1:
        raise ValueError(f"rollout.top_p={top_p} must be in (0, 1]")


def sample_tokens(
    logits: Tensor, *, temperature: float, top_p: float, generator: torch.Generator
) -> tuple[Tensor, Tensor]:
    """Sample one token per row of `logits` [R, V]; returns (tokens [R], logprobs [R]).

    The log-prob is that of the temperature-scaled distribution before top-p truncation — the
    distribution the trainer scores (`log_softmax(logits / temperature)`), so the train/rollout
    mismatch metrics compare like with like. Temperature 0 is greedy, scored at temperature 1.
    """
    check_sampling_args(temperature, top_p)
    logits = logits.float()
    if temperature == 0:
        tokens = logits.argmax(dim=-1)
        return tokens, torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, None]).squeeze(-1)
    logprobs = torch.log_softmax(logits / temperature, dim=-1)
    probs = logprobs.exp()
    if top_p < 1:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        outside = sorted_probs.cumsum(dim=-1) - sorted_probs >= top_p
        sorted_probs = sorted_probs.masked_fill(outside, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    tokens = torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)
