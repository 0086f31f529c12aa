"""The native trainer on the tiny Kimi-K2.6 with its vision tower (`model=tiny_kimi_vl`): images to
tokens within the budget, the model's names on the layout, the tower and projector bf16 in every
precision, log-probs given image + prompt, and the text path unchanged."""

from __future__ import annotations

import io
import random

import pytest
import torch
from PIL import Image

from skyq.quant.layouts import vision
from skyq.rl.batch import FinishReason, PromptImages, Sample, collate
from skyq.rl.image_tokens import ImageTokenError, expand, image_grid
from skyq.tools.make_dot_count import dot_image
from skyq.trainer.native.model import build_model
from skyq.trainer.native.vision import image_pixels

PRECISIONS = ["bf16", "fp8_blockwise", "mxfp8", "int4_qat"]


def _png(width: int, height: int) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), "gray").save(out, format="PNG")
    return out.getvalue()


def test_an_image_never_takes_more_tokens_than_the_budget():
    rng = random.Random(0)
    for _ in range(300):
        width, height, budget = rng.randrange(1, 3000), rng.randrange(1, 3000), rng.randrange(1, 300)
        rows, cols = image_grid(width, height, budget)
        assert rows >= 1 and cols >= 1 and rows * cols <= budget, (width, height, budget, rows, cols)
    assert image_grid(56, 56, 4) == (2, 2)  # fits at its own size: 28 pixels a token
    assert image_grid(50, 20, 256) == (1, 2)
    assert image_grid(2800, 280, 16) == (1, 12)  # 10 x 100 tokens shrunk by sqrt(16 / 1000)
    assert image_grid(28 * 20, 28 * 20, 256) == (16, 16)
    with pytest.raises(ImageTokenError, match="task.max_image_tokens=0"):
        image_grid(10, 10, 0)


def test_placeholders_expand_to_each_images_grid_and_the_pixels_match_it():
    small, wide = _png(56, 56), _png(28 * 16, 28)
    prompt = expand([1, 3, 9, 3, 4], (small, wide), token_id=3, max_tokens=16)
    assert prompt.images.grids == ((2, 2), (1, 16))
    assert list(prompt) == [1, *[3] * 4, 9, *[3] * 16, 4] and prompt.images.num_tokens == 20
    assert tuple(image_pixels(wide, (1, 16)).shape) == (3, 28, 28 * 16)
    with pytest.raises(ImageTokenError, match="2 image placeholder tokens .* for 1 image"):
        expand([3, 3], (small,), token_id=3, max_tokens=4)


def test_the_models_tensors_are_the_layouts_and_the_tower_is_bf16_in_every_precision(make_vl_trainer):
    for precision in PRECISIONS:
        trainer = make_vl_trainer(precision)  # checks its names against the layout itself
        hf = dict(trainer.hf_weights())
        assert "vision_tower.encoder.blocks.0.wqkv.weight" in hf and "mm_projector.proj.2.weight" in hf
        effective = trainer.effective_parameters()
        for name, master in trainer.model.named_parameters():
            if vision.is_vision_name(name):  # no fake quant: the bf16 rounding the wire carries
                assert torch.equal(effective[name], master.detach().to(torch.bfloat16).float()), (
                    precision,
                    name,
                )
        expert = "model.layers.1.mlp.experts.down_proj"
        quantized = not torch.equal(
            effective[expert], trainer.model.get_parameter(expert).detach().to(torch.bfloat16).float()
        )
        assert quantized is (precision != "bf16"), precision


def test_log_probs_are_given_the_image_and_a_text_batch_is_the_language_models_own(
    make_vl_trainer, vl_prompts
):
    trainer = make_vl_trainer("int4_qat")
    (prompt,), _ = vl_prompts(1)
    other = PromptImages(token_id=prompt.images.token_id, images=(dot_image(3, random.Random(5)),),
                         grids=prompt.images.grids)  # fmt: skip
    response = [5, 2]
    samples = [
        Sample(list(prompt), response, [0.0, 0.0], FinishReason.stop, images=i)
        for i in (prompt.images, other)
    ]
    batch = collate(samples, [1.0, 0.0], group_size=2, normalize_std=False, pad_token_id=2)
    assert batch.images == [prompt.images, other]
    with_images = trainer.logprobs(batch.input_ids, batch.attention_mask, batch.images)
    assert not torch.equal(with_images[0], with_images[1])  # same tokens, another image
    text = trainer.logprobs(batch.input_ids, batch.attention_mask)
    assert torch.equal(text[0], text[1]) and not torch.equal(text[0], with_images[0])
    # without images the composite is the bare language model, bit for bit
    model = build_model(trainer.model_cfg, seed=0)
    ids = batch.input_ids[:1]
    assert torch.equal(model(input_ids=ids).logits, model._lm(input_ids=ids).logits)
    # a row with fewer placeholders than its images' tokens is refused, naming the counts
    with pytest.raises(ValueError, match="row 0: 3 image placeholder tokens"):
        cut = batch.input_ids[:1].clone()
        cut[0, 1] = 9
        trainer.logprobs(cut, batch.attention_mask[:1], batch.images[:1])


def test_a_train_step_moves_the_tower_and_projector(make_vl_trainer, vl_prompts):
    trainer = make_vl_trainer("int4_qat")
    prompts, _ = vl_prompts(2)
    samples = [
        Sample(list(p), [4 + k, 2], [-1.0, -1.0], FinishReason.stop, images=p.images)
        for p in prompts
        for k in range(2)
    ]
    batch = collate(samples, [1.0, 0.0, 0.0, 1.0], group_size=2, normalize_std=False, pad_token_id=2)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if vision.is_vision_name(n)}
    trainer.train_step(batch)
    moved = [n for n, p in trainer.model.named_parameters() if n in before and not torch.equal(p, before[n])]
    assert "vision_tower.patch_embed.proj.weight" in moved and "mm_projector.proj.2.weight" in moved
