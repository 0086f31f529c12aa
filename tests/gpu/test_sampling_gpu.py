"""The engine's two-level token draw on the GPU: the tokens one full float64 scan draws, at Qwen3's
vocabulary, from log-softmax probabilities of bf16 logits as the engine computes them."""

from __future__ import annotations

import pytest
import torch

from skyq.rollout.sampling import draw_uniforms, full_scan, inverse_cdf

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize(("rows", "vocab"), [(512, 151936), (33, 20000), (7, 1025)])
def test_the_two_level_draw_is_the_full_scans_on_the_gpu(gen, rows, vocab):
    logits = (torch.randn(rows, vocab, generator=gen) * torch.logspace(0, 1, rows)[:, None]).to(
        torch.bfloat16
    )
    probs = torch.log_softmax(logits.cuda().float(), dim=-1).exp()
    u = draw_uniforms(gen, 1, rows)[0].cuda()
    assert torch.equal(inverse_cdf(probs, u), full_scan(probs, u))
