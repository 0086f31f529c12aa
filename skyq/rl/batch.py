"""What crosses between the loop, the rollout engines and the trainer: prompts with their images,
sampled responses and the training batch.

`Sample` is one response from a rollout engine; `collate` turns a step's samples and rewards into a
`RolloutBatch`: right-padded prompt+response sequences with token-aligned masks and log-probs. A
multimodal prompt is an `ImagePrompt` (its token ids, with its `PromptImages`); its samples and batch
rows carry the same `PromptImages`, so the engine and the trainer see the same images. Text-only
prompts, samples and batches carry none (`images` None) and are exactly what they always were.
"""

from __future__ import annotations

from collections.abc import Iterable
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
class PromptImages:
    """A prompt's images as both sides read them: encoded bytes, and each image's token grid."""

    token_id: int
    """The image placeholder token; the prompt holds rows * cols of them per image, in image order."""
    images: tuple[bytes, ...]
    """Encoded images (PNG / JPEG bytes, as the dataset holds them)."""
    grids: tuple[tuple[int, int], ...]
    """(rows, cols) of image tokens per image, within `task.max_image_tokens` (`skyq.rl.image_tokens`)."""

    def __post_init__(self) -> None:
        if len(self.images) != len(self.grids):
            raise ValueError(f"{len(self.images)} images but {len(self.grids)} grids")

    @property
    def num_tokens(self) -> int:
        return sum(rows * cols for rows, cols in self.grids)


class ImagePrompt(list):
    """A prompt's token ids (a list of ints, so every worker API that passes prompts carries it
    unchanged) with its images: what the loop gives an engine for a multimodal prompt."""

    def __init__(self, token_ids: Iterable[int], images: PromptImages) -> None:
        super().__init__(token_ids)
        self.images = images

    def __reduce__(self):  # pickled (Ray) as what it is, not as a bare list
        return (ImagePrompt, (list(self), self.images))


def images_of(prompt: list[int]) -> PromptImages | None:
    """The images of a prompt (an `ImagePrompt`), None for a text prompt."""
    return getattr(prompt, "images", None)


@dataclass(frozen=True, slots=True)
class Sample:
    prompt_ids: list[int]
    response_ids: list[int]
    """Sampled tokens, eos included when the response stopped."""
    logprobs: list[float]
    """Log-prob of each sampled token under the rollout model (after temperature)."""
    finish_reason: FinishReason
    images: PromptImages | None = None
    """The prompt's images (a multimodal prompt), None for text."""


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
    images: list[PromptImages | None] | None = None
    """Each row's prompt images (None for a text row); None for a batch without any image."""

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
            images=None if self.images is None else self.images[start:stop],
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
    images = [s.images for s in samples]
    return RolloutBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        response_mask=response_mask,
        rollout_logprobs=rollout_logprobs,
        advantages=group_advantages(reward_tensor, group_size, normalize_std),
        rewards=reward_tensor,
        images=images if any(i is not None for i in images) else None,
    )
