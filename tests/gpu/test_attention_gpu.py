"""skyq's decode attention on a GPU (`skyq.ops.attention`): at one query token with grouped heads and
a mask, the heads of a group as its query rows give the attention of the expanded cache (what
transformers 5.17's `sdpa` computes through `repeat_kv`), in bf16 within its rounding, and from a
CUDA graph too."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers.integrations import sdpa_attention

from skyq.ops import attention

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


class _Attn(nn.Module):
    def __init__(self, groups: int) -> None:
        super().__init__()
        self.num_key_value_groups = groups


@pytest.mark.parametrize(
    ("b", "h", "hkv", "t", "d"), [(64, 16, 4, 64, 64), (1, 32, 4, 128, 128), (7, 8, 2, 200, 64)]
)
def test_packed_decode_equals_attention_over_the_expanded_cache(gen, b, h, hkv, t, d):
    q = torch.randn(b, h, 1, d, generator=gen).to(torch.bfloat16).cuda()
    k = torch.randn(b, hkv, t, d, generator=gen).to(torch.bfloat16).cuda()
    v = torch.randn(b, hkv, t, d, generator=gen).to(torch.bfloat16).cuda()
    mask = (torch.rand(b, 1, 1, t, generator=gen) > 0.4).cuda()
    mask[..., 0] = True
    ours, _ = attention.sdpa_attention_forward(_Attn(h // hkv), q, k, v, mask, scaling=d**-0.5)
    groups = h // hkv
    ref = torch.nn.functional.scaled_dot_product_attention(
        q,
        sdpa_attention.repeat_kv(k, groups),
        sdpa_attention.repeat_kv(v, groups),
        attn_mask=mask,
        scale=d**-0.5,
    ).transpose(1, 2)
    assert ours.shape == ref.shape == (b, 1, h, d)
    torch.testing.assert_close(ours.float(), ref.float(), rtol=2e-2, atol=2e-2)
    exact = (q.double() @ sdpa_attention.repeat_kv(k, groups).double().transpose(-1, -2)) * d**-0.5
    exact = exact.masked_fill(~mask, float("-inf")).softmax(-1) @ sdpa_attention.repeat_kv(v, groups).double()
    err_ours = (ours.double() - exact.transpose(1, 2)).abs().max()
    err_ref = (ref.double() - exact.transpose(1, 2)).abs().max()
    assert err_ours <= 2 * err_ref + 1e-3, (err_ours, err_ref)  # as close to exact as the stock way


def test_replays_from_a_cuda_graph(gen):
    b, h, hkv, t, d = 8, 16, 4, 64, 64
    q, k, v = (
        torch.randn(*s, generator=gen).to(torch.bfloat16).cuda()
        for s in ((b, h, 1, d), (b, hkv, t, d), (b, hkv, t, d))
    )
    mask = torch.ones(b, 1, 1, t, dtype=torch.bool, device="cuda")
    module = _Attn(h // hkv)
    attention.sdpa_attention_forward(module, q, k, v, mask)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        attention.sdpa_attention_forward(module, q, k, v, mask)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, _ = attention.sdpa_attention_forward(module, q, k, v, mask)
    q.copy_(torch.randn(b, h, 1, d, generator=gen).to(torch.bfloat16))
    mask[:, :, :, 40:] = False
    graph.replay()
    assert torch.equal(out, attention.sdpa_attention_forward(module, q, k, v, mask)[0])


@pytest.mark.parametrize("t", [7, 33, 130])
def test_multi_position_attention_never_runs_cudnn(gen, t):
    """A masked bf16 prompt / training call laid out as transformers lays it out (q, k, v transposed
    views of [B, T, H, D], a boolean [B, 1, T, T] causal + padding mask), forward and backward: no cuDNN
    attention op or kernel runs (cuDNN builds a plan per new shape, seconds at every new sequence
    length), and output and gradients are as close to the float64 attention's as transformers' own
    call with torch's default backends."""
    from torch.profiler import ProfilerActivity, profile

    b, h, hkv, d = 4, 16, 4, 64
    inputs = [
        torch.randn(b, t, n, d, generator=gen).to(torch.bfloat16).cuda().transpose(1, 2)
        for n in (h, hkv, hkv)
    ]
    lengths = torch.tensor([t, t - 1, max(1, t // 2), 1], device="cuda")
    keep = torch.arange(t, device="cuda")[None, :] < lengths[:, None]
    mask = torch.ones(t, t, dtype=torch.bool, device="cuda").tril()[None, None] & keep[:, None, None, :]
    mask = mask | torch.eye(t, dtype=torch.bool, device="cuda")  # a padded query row attends to itself
    module = _Attn(h // hkv)
    module.is_causal = True

    def run(forward):
        q, k, v = (x.detach().requires_grad_() for x in inputs)
        out, _ = forward(module, q, k, v, mask, scaling=d**-0.5)
        out.float().square().sum().backward()
        return out.double(), [x.grad.double() for x in (q, k, v)]

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        ours = run(attention.sdpa_attention_forward)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events()]
    assert not [n for n in names if "cudnn" in n.lower()], "multi-position attention ran cuDNN"
    assert [n for n in names if "efficient_attention" in n], sorted(set(names))[:50]
    stock = run(sdpa_attention.sdpa_attention_forward)
    groups = h // hkv
    q64, k64, v64 = (x.double().requires_grad_() for x in inputs)
    scores = (q64 @ sdpa_attention.repeat_kv(k64, groups).transpose(-1, -2)) * d**-0.5
    exact = scores.masked_fill(~mask, float("-inf")).softmax(-1) @ sdpa_attention.repeat_kv(v64, groups)
    exact = exact.transpose(1, 2)
    exact.float().square().sum().backward()
    for got, ref, want in zip(
        [ours[0], *ours[1]],
        [stock[0], *stock[1]],
        [exact.detach(), q64.grad, k64.grad, v64.grad],
        strict=True,
    ):
        err, err_stock = (got - want).abs().max(), (ref - want).abs().max()
        assert err <= 2 * err_stock + 1e-3, (float(err), float(err_stock))
