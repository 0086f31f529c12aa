"""collate: right-padded token-aligned batches with group advantages."""

from __future__ import annotations

import pytest
import torch

from skyq.rl.batch import FinishReason, Sample, collate


def test_collate_aligns_masks_and_logprobs_with_tokens():
    samples = [
        Sample([1, 5, 6], [7, 2], [-0.5, -0.1], FinishReason.stop),
        Sample([1, 5], [8, 9, 9], [-1.0, -2.0, -3.0], FinishReason.length),
    ]
    batch = collate(samples, [1.0, 0.0], group_size=2, normalize_std=False, pad_token_id=0)
    assert batch.input_ids.tolist() == [[1, 5, 6, 7, 2], [1, 5, 8, 9, 9]]
    assert batch.response_mask.tolist() == [[0, 0, 0, 1, 1], [0, 0, 1, 1, 1]]
    assert batch.rollout_logprobs[0].tolist() == pytest.approx([0, 0, 0, -0.5, -0.1])
    assert batch.advantages.tolist() == [0.5, -0.5]
    padded = collate(samples[:1] + samples[:1], [1.0, 1.0], group_size=2, normalize_std=True, pad_token_id=0)
    assert torch.equal(padded.advantages, torch.zeros(2))
    assert len(batch.slice(1, 2)) == 1


def test_collate_refuses_mismatched_inputs():
    sample = Sample([1], [2], [-0.1, -0.2], FinishReason.stop)
    with pytest.raises(ValueError, match="1 response tokens but 2 logprobs"):
        collate([sample], [1.0], group_size=1, normalize_std=False, pad_token_id=0)
    with pytest.raises(ValueError, match="2 rewards"):
        collate([sample], [1.0, 0.0], group_size=1, normalize_std=False, pad_token_id=0)
