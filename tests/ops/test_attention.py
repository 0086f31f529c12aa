"""`skyq.ops.attention`: one-token attention over grouped key/value heads with the query heads of a
group as its rows (no copy of the cache), everything else transformers' own `sdpa` function; the
models skyq builds use it."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import Qwen3MoeForCausalLM
from transformers.integrations import sdpa_attention

from skyq import ops
from skyq.checkpoint.hf_config import hf_config
from skyq.config.store import compose, to_object
from skyq.ops import attention
from skyq.rollout.embedded import EmbeddedEngine, _cache_kwarg
from skyq.trainer.native.model import build_model


class _Attn(nn.Module):
    """What transformers' attention functions read off the module."""

    def __init__(self, groups: int) -> None:
        super().__init__()
        self.num_key_value_groups = groups
        self.is_causal = True


def _inputs(b=3, h=8, hkv=2, t=11, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, 1, d, generator=g)
    k, v = torch.randn(b, hkv, t, d, generator=g), torch.randn(b, hkv, t, d, generator=g)
    mask = torch.rand(b, 1, 1, t, generator=g) > 0.3
    mask[..., -1] = True  # every row attends to its own position at least
    return q, k, v, mask


def _reference(q, k, v, mask, groups, scaling):
    """Attention of each query head over its key/value head, the cache expanded (`repeat_kv`)."""
    kr, vr = sdpa_attention.repeat_kv(k, groups), sdpa_attention.repeat_kv(v, groups)
    scores = (q.double() @ kr.double().transpose(-1, -2)) * scaling
    scores = scores.masked_fill(~mask, float("-inf"))
    return (scores.softmax(-1) @ vr.double()).transpose(1, 2)


@pytest.mark.parametrize("per_head", [False, True])
def test_one_token_packs_the_group_into_rows_and_equals_expanded_attention(monkeypatch, per_head):
    q, k, v, mask = _inputs()
    if per_head:  # a mask row per query head: each head's own
        mask = torch.rand(3, 8, 1, 11, generator=torch.Generator().manual_seed(1)) > 0.3
        mask[..., -1] = True

    def stock(*args, **kwargs):
        raise AssertionError("a one-token step with a mask went to transformers' function (repeat_kv)")

    monkeypatch.setattr(sdpa_attention, "sdpa_attention_forward", stock)
    out, weights = attention.sdpa_attention_forward(_Attn(4), q, k, v, mask, scaling=0.25)
    assert weights is None and out.shape == (3, 1, 8, 16) and out.is_contiguous()
    torch.testing.assert_close(out.double(), _reference(q, k, v, mask, 4, 0.25), rtol=1e-5, atol=1e-6)


def test_a_mask_that_differs_between_heads_of_a_group_is_honoured():
    q, k, v, _ = _inputs()
    mask = torch.ones(3, 8, 1, 11, dtype=torch.bool)
    mask[:, 1, :, :5] = False  # head 1 only (group 0 with heads 0-3) ignores the first 5 positions
    out, _ = attention.sdpa_attention_forward(_Attn(4), q, k, v, mask, scaling=0.25)
    ref = _reference(q, k, v, mask, 4, 0.25)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-6)
    full, _ = attention.sdpa_attention_forward(_Attn(4), q, k, v, torch.ones_like(mask), scaling=0.25)
    assert not torch.allclose(full[:, :, 1], out[:, :, 1]) and torch.equal(full[:, :, 0], out[:, :, 0])


@pytest.mark.parametrize(
    "case", ["prompt", "no_mask", "no_groups", "position_bias"], ids=lambda c: c.replace("_", "-")
)
def test_everything_else_is_transformers_own_function(case):
    q, k, v, mask = _inputs()
    groups, kwargs = 4, {}
    if case == "prompt":
        q = torch.randn(3, 8, 11, 16, generator=torch.Generator().manual_seed(2))
        mask = torch.ones(3, 1, 11, 11, dtype=torch.bool).tril()
    elif case == "no_mask":
        mask = None
    elif case == "no_groups":
        k, v, groups = k.repeat_interleave(4, 1), v.repeat_interleave(4, 1), 1
    else:
        kwargs["position_bias"] = torch.zeros(3, 8, 1, 11)
    ours = attention.sdpa_attention_forward(_Attn(groups), q, k, v, mask, scaling=0.25, **kwargs)
    stock = sdpa_attention.sdpa_attention_forward(_Attn(groups), q, k, v, mask, scaling=0.25, **kwargs)
    assert torch.equal(ours[0], stock[0])


_FLAGS = {
    "cudnn": torch.backends.cuda.cudnn_sdp_enabled,
    "flash": torch.backends.cuda.flash_sdp_enabled,
    "efficient": torch.backends.cuda.mem_efficient_sdp_enabled,
    "math": torch.backends.cuda.math_sdp_enabled,
}


def _backend_flags() -> dict[str, bool]:
    return {name: flag() for name, flag in _FLAGS.items()}


def test_multi_position_backends_leave_cudnn_out_on_cuda_only():
    """torch's SDPA backend switches are process-wide flags, readable without a GPU: inside the
    context for a CUDA device cuDNN is off and flash / memory-efficient / math stay on; on leaving,
    the flags are what they were; for a CPU device nothing is touched."""
    before = _backend_flags()
    assert before["cudnn"], "torch's default enables cuDNN attention; the test needs it on to see it go"
    with attention.multi_position_backends(torch.device("cuda")):
        inside = _backend_flags()
    assert inside == {"cudnn": False, "flash": True, "efficient": True, "math": True}
    assert _backend_flags() == before
    with attention.multi_position_backends(torch.device("cpu")):
        assert _backend_flags() == before


@pytest.mark.parametrize("queries", [1, 11])
def test_only_multi_position_calls_run_in_the_restricted_backends(monkeypatch, queries):
    """The prompt / scoring / training path (more than one query position) runs inside
    `multi_position_backends(query.device)`; the packed one-token decode does not (its shapes are
    fixed per captured decoder, so cuDNN's plans are built once there)."""
    entered = []
    real = attention.multi_position_backends

    def recording(device):
        entered.append(device)
        return real(device)

    monkeypatch.setattr(attention, "multi_position_backends", recording)
    q, k, v, mask = _inputs()
    if queries > 1:
        q = torch.randn(3, 8, queries, 16, generator=torch.Generator().manual_seed(2))
        mask = torch.ones(3, 1, queries, 11, dtype=torch.bool).tril()
    attention.sdpa_attention_forward(_Attn(4), q, k, v, mask, scaling=0.25)
    assert entered == ([q.device] if queries > 1 else [])


def test_install_sets_the_models_built_by_skyq_and_leaves_other_implementations():
    cfg = to_object(compose([]))
    for model in (
        build_model(cfg.model, seed=3),
        EmbeddedEngine(model_cfg=cfg.model, precision_cfg=cfg.precision, seed=0).model,
    ):
        assert model.config._attn_implementation == attention.NAME
    eager = Qwen3MoeForCausalLM(hf_config(cfg.model))
    eager.set_attn_implementation("eager")
    ops.install(eager)
    assert eager.config._attn_implementation == "eager"


def test_a_padded_decode_step_of_the_installed_model_equals_the_stock_model():
    """The installed model's decode (one token a row over a cache, left-padded rows) gives the stock
    model's logits; its prompt pass gives them bit for bit (transformers' own function)."""
    cfg = to_object(compose([]))
    model = Qwen3MoeForCausalLM(hf_config(cfg.model)).eval()
    stock = Qwen3MoeForCausalLM(hf_config(cfg.model)).eval()
    stock.load_state_dict(model.state_dict())
    ops.install(model)
    assert model.config.num_attention_heads > model.config.num_key_value_heads  # grouped heads
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.model.vocab_size, (3, 7), generator=g)
    pad = torch.ones(3, 7, dtype=torch.long)
    pad[0, :3] = 0  # row 0 left-padded
    nxt = torch.randint(0, cfg.model.vocab_size, (3, 1), generator=g)
    cache_kwarg = _cache_kwarg(Qwen3MoeForCausalLM)  # `cache` in newer transformers
    logits = []
    with torch.no_grad():
        for m in (model, stock):
            first = m(input_ids=ids, attention_mask=pad, use_cache=True)
            step = m(
                input_ids=nxt, attention_mask=torch.cat([pad, torch.ones(3, 1, dtype=torch.long)], 1),
                **{cache_kwarg: first.past_key_values}, use_cache=True,
            )  # fmt: skip
            logits.append((first.logits, step.logits))
    assert torch.equal(logits[0][0], logits[1][0])
    torch.testing.assert_close(logits[0][1], logits[1][1], rtol=1e-5, atol=1e-5)
