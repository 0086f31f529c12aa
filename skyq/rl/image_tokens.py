"""A multimodal prompt's images as image tokens: each image's token grid within `task.max_image_tokens`,
and the prompt's image placeholders expanded to that many tokens.

The chat template renders one placeholder token per image (Kimi-K2.6's `<|media_pad|>`). The model
turns an image into one token per 28 x 28 pixels (2 x 2 patches of 14, merged by the projector), so an
image of W x H pixels would take ceil(H / 28) * ceil(W / 28) tokens. An image that needs more than
`max_image_tokens` is shrunk, keeping its aspect ratio, to the largest grid within the budget (as Kimi's
processor limits an image's patches): rows = floor(r * s), cols = floor(c * s) with
s = sqrt(max / (r * c)), at least 1 each, then the larger side is cut until rows * cols <= max. The
engine and the trainer resize each image to exactly its grid (`skyq.trainer.native.vision`), so the
count here is the count they produce, and never exceeds the budget.
"""

from __future__ import annotations

import math

from skyq.rl.batch import ImagePrompt, PromptImages
from skyq.rl.images import decode

IMAGE_TOKEN = "<|media_pad|>"
"""The image placeholder token of Kimi-K2.5/K2.6's chat template (`media_placeholder_token_id`)."""
TOKEN_PIXELS = 28
"""Pixels per image token along each side: 2 x 2 merged patches of 14 pixels."""


class ImageTokenError(ValueError):
    """A multimodal prompt the model cannot be given (no placeholder token, counts that differ)."""


def image_grid(width: int, height: int, max_tokens: int) -> tuple[int, int]:
    """(rows, cols) of image tokens for a `width` x `height` image, rows * cols <= `max_tokens`."""
    if max_tokens < 1:
        raise ImageTokenError(f"task.max_image_tokens={max_tokens}: an image needs at least one token")
    rows, cols = math.ceil(height / TOKEN_PIXELS), math.ceil(width / TOKEN_PIXELS)
    if rows * cols <= max_tokens:
        return rows, cols
    scale = math.sqrt(max_tokens / (rows * cols))
    rows, cols = max(1, math.floor(rows * scale)), max(1, math.floor(cols * scale))
    while rows * cols > max_tokens:
        if rows >= cols:
            rows -= 1
        else:
            cols -= 1
    return rows, cols


def image_token_id(tokenizer) -> int:
    """The id of `IMAGE_TOKEN` in the model's tokenizer; refused unless it is one token."""
    ids = tokenizer.encode(IMAGE_TOKEN)
    if len(ids) != 1:
        raise ImageTokenError(
            f"the model's tokenizer encodes the image placeholder {IMAGE_TOKEN!r} as {len(ids)} tokens {ids}; a "
            "multimodal task needs it as one special token (Kimi-K2.6's tokenizer has it). Fix: add it to the "
            "tokenizer's special tokens, with a chat template that renders each image part as it"
        )
    return ids[0]


def expand(token_ids: list[int], images: tuple[bytes, ...], *, token_id: int, max_tokens: int) -> ImagePrompt:
    """The prompt with its i-th placeholder expanded to image i's rows * cols tokens, carrying its images."""
    count = token_ids.count(token_id)
    if count != len(images):
        raise ImageTokenError(
            f"a prompt holds {count} image placeholder tokens (id {token_id}) for {len(images)} image(s): the "
            "chat template must render each image part as one placeholder"
        )
    grids = tuple(image_grid(*decode(data).size, max_tokens) for data in images)
    out: list[int] = []
    grid_iter = iter(grids)
    for tid in token_ids:
        if tid == token_id:
            rows, cols = next(grid_iter)
            out.extend([token_id] * (rows * cols))
        else:
            out.append(tid)
    return ImagePrompt(out, PromptImages(token_id=token_id, images=images, grids=grids))
