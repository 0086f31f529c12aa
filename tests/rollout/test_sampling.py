"""Temperature / top-p sampling by inverting the cumulative distribution, and the log-probs it reports."""

from __future__ import annotations

import pytest
import torch

from skyq.rollout.sampling import CHUNK, draw_uniforms, full_scan, inverse_cdf, sample_tokens


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


@pytest.mark.parametrize("vocab", [3, 1023, 1024, 1025, 5000, 40960])
def test_the_two_level_search_draws_what_one_full_scan_draws(vocab):
    """Random peaked and flat distributions (some tokens of zero probability), uniforms over [0, 1)
    and at its ends: the chunked search picks the full scan's token in every row."""
    gen = torch.Generator().manual_seed(vocab)
    rows = 256
    logits = torch.randn(rows, vocab, generator=gen) * torch.logspace(-1, 1.5, rows)[:, None]
    probs = torch.softmax(logits, dim=-1)
    probs[probs < 1e-7] = 0.0  # zero-probability tokens, as a nucleus cut leaves
    probs[:, 0] += 1e-3  # every row keeps some mass
    u = draw_uniforms(gen, 1, rows)[0]
    u[:3] = torch.tensor([0.0, 0.5, 1.0 - 2**-53], dtype=torch.float64)
    assert torch.equal(inverse_cdf(probs, u), full_scan(probs, u))


def test_the_last_kept_token_bounds_the_draw_across_empty_chunks():
    """Mass only in the first of three chunks, u at the top of [0, 1): the last token with mass, never
    one of the empty chunks' (nor a zero-probability token inside the chosen chunk)."""
    probs = torch.zeros(2, 3 * CHUNK + 7)
    probs[:, :10] = 0.1
    probs[1, 5] = 0.0
    probs[1, 9] = 0.0
    u = torch.tensor([1.0 - 2**-53, 1.0 - 2**-53], dtype=torch.float64)
    assert inverse_cdf(probs, u).tolist() == [9, 8]
    assert inverse_cdf(probs, torch.zeros(2, dtype=torch.float64)).tolist() == [0, 0]


def test_a_chunk_whose_scan_rounds_below_its_sum_keeps_the_draw_inside_it():
    """One large and many tiny probabilities: the chunk's sum keeps the tiny ones, its float64 scan
    (sequential from the large one) loses them, so a target between the two lies past the scan's
    end: the draw is the chunk's last token of nonzero mass, not the next chunk's first (zero)."""
    probs = torch.zeros(1, 2 * CHUNK)
    probs[0, :CHUNK] = 2.0**-60
    probs[0, 0] = 1.0
    probs[0, CHUNK - 1] = 0.0
    sums = probs[:, :CHUNK].sum(dim=-1, dtype=torch.float64)
    assert float(sums) > float(probs.double().cumsum(dim=-1)[0, -1])  # this CPU's sum keeps the tiny ones
    u = torch.tensor([1.0 - 2**-53], dtype=torch.float64)
    assert inverse_cdf(probs, u).tolist() == [CHUNK - 2]


def test_a_target_at_the_total_stays_in_the_last_chunk_with_mass():
    """u * total rounded up to the total (u = 1 here): the last chunk holding mass, not an empty one
    after it; one full scan stops at the last token with mass too."""
    probs = torch.zeros(1, 3 * CHUNK)
    probs[0, 100:200] = 0.01
    assert inverse_cdf(probs, torch.ones(1, dtype=torch.float64)).tolist() == [199]
    assert full_scan(probs, torch.ones(1, dtype=torch.float64)).tolist() == [199]


def test_a_row_without_positive_mass_draws_a_token_in_range():
    """NaN logits (which the engine reports by the step's non-finite log-prob) or an all-zero row:
    token 0, never an index outside the vocabulary."""
    probs = torch.zeros(2, CHUNK + 5)
    probs[0] = float("nan")
    assert inverse_cdf(probs, torch.full((2,), 0.5, dtype=torch.float64)).tolist() == [0, 0]
    assert full_scan(probs, torch.full((2,), 0.5, dtype=torch.float64)).tolist() == [0, 0]


def test_large_vocabularies_draw_by_the_two_level_search(monkeypatch):
    """`sample_tokens` takes `inverse_cdf` above `FULL_SCAN_MAX_VOCAB` tokens, one scan up to it."""
    from skyq.rollout import sampling

    calls = []
    for name in ("inverse_cdf", "full_scan"):
        real = getattr(sampling, name)
        monkeypatch.setattr(sampling, name, lambda p, u, _r=real, _n=name: calls.append(_n) or _r(p, u))
    for vocab in (sampling.FULL_SCAN_MAX_VOCAB, sampling.FULL_SCAN_MAX_VOCAB + 1):
        sample_tokens(torch.zeros(2, vocab), temperature=1.0, top_p=1.0, uniforms=_u(2))
    assert calls == ["full_scan", "inverse_cdf"]
