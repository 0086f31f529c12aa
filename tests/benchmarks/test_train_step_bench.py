"""benchmarks/train_step.py's new-length batches: the same sequences, longer only by masked padding, so a
step at a new length measures what the new shape costs, not different work."""

from __future__ import annotations

import importlib
from pathlib import Path

import torch

from skyq.rl.batch import FinishReason, Sample, collate

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def _batch(rows: int = 8):
    gen = torch.Generator().manual_seed(0)
    samples = []
    for r in range(rows):
        response = torch.randint(3, 13, (1 + r % 3,), generator=gen).tolist()
        samples.append(
            Sample([1, 3 + r % 10, 13, 5, 18], response, [-0.5] * len(response), FinishReason.length)
        )
    return collate(
        samples, [float(r % 2) for r in range(rows)], group_size=4, normalize_std=True, pad_token_id=0
    )


def test_right_padded_batches_hold_the_same_sequences_at_a_longer_length(monkeypatch, make_trainer):
    monkeypatch.syspath_prepend(str(BENCH))
    bench = importlib.import_module("train_step")
    batch = _batch()
    longer = bench.right_padded(batch, 3)
    t = batch.input_ids.shape[1]
    assert longer.input_ids.shape == (len(batch), t + 3)
    for name in ("input_ids", "attention_mask", "response_mask", "rollout_logprobs"):
        assert torch.equal(getattr(longer, name)[:, :t], getattr(batch, name)), name
    assert not longer.attention_mask[:, t:].any() and not longer.response_mask[:, t:].any()
    assert torch.equal(longer.advantages, batch.advantages) and torch.equal(longer.rewards, batch.rewards)
    trainer = make_trainer("bf16")
    short, padded = (trainer.logprobs(b.input_ids, b.attention_mask) for b in (batch, longer))
    real = batch.response_mask.bool()
    torch.testing.assert_close(padded[:, :t][real], short[real], rtol=1e-5, atol=1e-5)
