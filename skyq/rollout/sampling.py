"""Token sampling with temperature and nucleus (top-p) truncation, reproducible from a generator.

A token is drawn by inverting the cumulative distribution with one uniform number per row: the
uniforms come from the call's seeded CPU generator (`draw_uniforms`, all of a call's steps at
once), and the draw itself is a few tensor ops on the logits' device. So a GPU engine samples
without moving logits to the host or running the sampler there (the decode loop never waits for
the host between steps), and the CPU and GPU engines draw the same tokens from the same seed
wherever their probabilities agree (float rounding can move a draw that falls within a rounding
error of a boundary between two tokens).
"""

from __future__ import annotations

import torch
from torch import Tensor


def check_sampling_args(temperature: float, top_p: float) -> None:
    if temperature < 0:
        raise ValueError(f"rollout.temperature={temperature} must be >= 0 (0 = greedy)")
    if not 0 < top_p <= 1:
        raise ValueError(f"rollout.top_p={top_p} must be in (0, 1]")


def draw_uniforms(generator: torch.Generator, steps: int, rows: int) -> Tensor:
    """[steps, rows] float64 uniforms in [0, 1) from `generator`: one per row per decode step."""
    return torch.rand((steps, rows), generator=generator, dtype=torch.float64)


def sample_tokens(
    logits: Tensor, *, temperature: float, top_p: float, uniforms: Tensor
) -> tuple[Tensor, Tensor]:
    """Sample one token per row of `logits` [R, V] with `uniforms` [R] in [0, 1) (on the logits'
    device); returns (tokens [R], logprobs [R]), no host sync.

    The token is the first whose cumulative probability (vocabulary order, float64 sums of the
    fp32 probabilities) exceeds u times the total, over the temperature-scaled distribution cut to
    its nucleus: the smallest set of most probable tokens whose mass reaches top_p (the most
    probable token always stays). The log-prob is that of the temperature-scaled distribution
    before the cut — the distribution the trainer scores (`log_softmax(logits / temperature)`), so
    the train/rollout mismatch metrics compare like with like. Temperature 0 is greedy, scored at
    temperature 1."""
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
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs.masked_fill(outside, 0.0))
    cdf = probs.double().cumsum(dim=-1)
    target = uniforms.to(cdf.device, torch.float64)[:, None] * cdf[:, -1:]
    tokens = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    # u * total can round up to the total: never past the last token the cut kept
    last_kept = (probs > 0).long().cumsum(dim=-1).argmax(dim=-1)
    tokens = torch.minimum(tokens, last_kept)
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)
