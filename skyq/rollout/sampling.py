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
    u = uniforms.to(probs.device, torch.float64)
    tokens = inverse_cdf(probs, u) if probs.shape[-1] > FULL_SCAN_MAX_VOCAB else full_scan(probs, u)
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)


CHUNK = 1024
"""Vocabulary entries per chunk of `inverse_cdf`'s two-level search."""

FULL_SCAN_MAX_VOCAB = 32768
"""Vocabularies up to this size draw by one scan (`full_scan`), larger ones by `inverse_cdf`: in
`benchmarks/sampling.py` (docs/benchmarks.md) one scan wins at small vocabularies, where the two
levels are more and smaller launches, the two are even at this size, and the two levels win at
Qwen3's 151936 tokens."""


def full_scan(probs: Tensor, u: Tensor) -> Tensor:
    """`inverse_cdf`'s draw by one float64 scan of each row's whole vocabulary, bounded by its last
    token of nonzero mass (a target that rounds up to the total; one reduction, not a second scan,
    which an integer scan + argmax would be)."""
    cdf = probs.double().cumsum(dim=-1)
    tokens = torch.searchsorted(cdf, u[:, None] * cdf[:, -1:], right=True).squeeze(-1)
    ids = torch.arange(probs.shape[-1], device=probs.device)
    last_kept = torch.where(probs > 0, ids, -1).amax(dim=-1).clamp(min=0)
    return torch.minimum(tokens, last_kept)


def inverse_cdf(probs: Tensor, u: Tensor) -> Tensor:
    """Per row of probs [R, V] (nonnegative fp32, a positive total), the first token whose running
    float64 sum in vocabulary order exceeds u [R] (float64, in [0, 1)) times the row's total, never
    a token of zero probability. In two levels, so no scan runs over the whole vocabulary (`full_scan`'s
    scans dominate the draw at a large vocabulary, see `FULL_SCAN_MAX_VOCAB`):
    the sums of chunks of `CHUNK` tokens, a scan over those, and a scan inside the chosen chunk from
    its predecessors' sum. The sums are float64 of fp32 values, so only a target within a rounding
    error of a boundary between two tokens can fall on the other side than one full scan puts it."""
    rows, vocab = probs.shape
    full = vocab // CHUNK
    sums = (
        [probs[:, : full * CHUNK].reshape(rows, full, CHUNK).sum(dim=-1, dtype=torch.float64)] if full else []
    )
    if vocab > full * CHUNK:
        sums.append(probs[:, full * CHUNK :].sum(dim=-1, dtype=torch.float64, keepdim=True))
    chunk_sums = torch.cat(sums, dim=-1) if len(sums) > 1 else sums[0]
    chunk_cdf = chunk_sums.cumsum(dim=-1)
    target = u[:, None] * chunk_cdf[:, -1:]
    # u * total can round up to the total: never past the last chunk holding mass
    chunk_ids = torch.arange(chunk_sums.shape[1], device=probs.device).expand_as(chunk_sums)
    last_chunk = torch.where(chunk_sums > 0, chunk_ids, -1).amax(dim=-1, keepdim=True)
    # (a row without positive mass, e.g. NaN logits, which the caller reports: token 0, in range)
    chunk = torch.minimum(torch.searchsorted(chunk_cdf, target, right=True), last_chunk).clamp(min=0)
    before = torch.where(chunk > 0, chunk_cdf.gather(-1, (chunk - 1).clamp(min=0)), 0.0)
    cols = chunk * CHUNK + torch.arange(CHUNK, device=probs.device)
    inside = cols < vocab
    values = probs.gather(-1, cols.clamp(max=vocab - 1)).masked_fill(~inside, 0.0)
    local_cdf = before + values.double().cumsum(dim=-1)
    local = torch.searchsorted(local_cdf, target, right=True)
    # the chunk's own sum and its scan may round apart: never past its last token of nonzero mass
    offsets = torch.arange(CHUNK, device=probs.device).expand_as(values)
    last_kept = torch.where(values > 0, offsets, -1).amax(dim=-1, keepdim=True)
    return (chunk * CHUNK + torch.minimum(local, last_kept).clamp(min=0)).squeeze(-1)
