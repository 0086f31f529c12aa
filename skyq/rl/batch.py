"""What crosses from the rollout side to the trainer: sampled responses and the training batch.

`Sample` is one response from a rollout engine; `collate` turns a step's samples and rewards into a
`RolloutBatch`: right-padded prompt+response sequences with token-aligned masks and log-probs.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch
from torch import Tensor

from skyq.rl.grpo import group_advantages


class FinishReason(str, Enum):
    stop = "stop"
    """The response ended with eos."""
    length = "length"
    """The response reached max_new_tokens without eos."""


@dataclass(frozen=True, slots=True)
class Sample:
    prompt_ids: list[int]
    response_ids: list[int]
    """Sampled tokens, eos included when the response stopped."""
    logprobs: list[float]
    """Log-prob of each sampled token under the rollout model (after temperature)."""
    finish_reason: FinishReason


@dataclass(slots=True)
class RolloutBatch:
    """One training step's sequences. Token-aligned [B, T] tensors: position t holds token t."""

    input_ids: Tensor
    """[B, T] int64, prompt then response, right-padded."""
    attention_mask: Tensor
    """[B, T] int64, 1 on real tokens."""
    response_mask: Tensor
    """[B, T] float32, 1 on response tokens (the ones the loss sees)."""
    rollout_logprobs: Tensor
    """[B, T] float32, the engine's log-prob of each response token, 0 elsewhere."""
    advantages: Tensor
    """[B] float32, one per sequence."""
    rewards: Tensor
    """[B] float32."""

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def slice(self, start: int, stop: int) -> RolloutBatch:
        """Rows [start, stop) (a micro-batch)."""
        return RolloutBatch(
            input_ids=self.input_ids[start:stop],
            attention_mask=self.attention_mask[start:stop],
            response_mask=self.response_mask[start:stop],
            rollout_logprobs=self.rollout_logprobs[start:stop],
            advantages=self.advantages[start:stop],
            rewards=self.rewards[start:stop],
        )


def collate(
    samples: list[Sample], rewards: list[float], *, group_size: int, normalize_std: bool, pad_token_id: int
) -> RolloutBatch:
    """Pack samples (groups of `group_size` consecutive responses per prompt) into a RolloutBatch."""
    if len(samples) != len(rewards):
        raise ValueError(f"collate got {len(samples)} samples but {len(rewards)} rewards")
    if not samples:
        raise ValueError("collate got no samples")
    for i, sample in enumerate(samples):
        if len(sample.logprobs) != len(sample.response_ids):
            raise ValueError(
                f"sample {i}: {len(sample.response_ids)} response tokens but {len(sample.logprobs)} logprobs"
            )
    length = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    batch_size = len(samples)
    input_ids = torch.full((batch_size, length), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((batch_size, length), dtype=torch.long)
    response_mask = torch.zeros((batch_size, length), dtype=torch.float32)
    rollout_logprobs = torch.zeros((batch_size, length), dtype=torch.float32)
    for row, sample in enumerate(samples):
        prompt_len, total = len(sample.prompt_ids), len(sample.prompt_ids) + len(sample.response_ids)
        input_ids[row, :total] = torch.tensor([*sample.prompt_ids, *sample.response_ids], dtype=torch.long)
        attention_mask[row, :total] = 1
        response_mask[row, prompt_len:total] = 1.0
        rollout_logprobs[row, prompt_len:total] = torch.tensor(sample.logprobs, dtype=torch.float32)
    reward_tensor = torch.tensor(rewards, dtype=torch.float32)
    return RolloutBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        response_mask=response_mask,
        rollout_logprobs=rollout_logprobs,
        advantages=group_advantages(reward_tensor, group_size, normalize_std),
        rewards=reward_tensor,
    )
