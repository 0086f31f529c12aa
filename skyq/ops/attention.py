"""Scaled-dot-product attention for transformers' models, without a copy of the KV cache at decode.

With grouped-query attention (fewer key/value heads than query heads) transformers' `sdpa` function, in
the releases the GPU image carries (5.17), expands every key and value head to its query heads whenever a
mask is given (`repeat_kv`: a copy of the whole cache per layer and step), and the engine always gives
one: a padded batch, a fixed-capacity cache. At decode the query is one token, so the query heads of a
group can instead be that group's query rows: q [B, H, 1, D] becomes [B, Hkv, H / Hkv, D] against the
cache's own [B, Hkv, T, D], a mask shared by the heads broadcast over the rows. Each head's attention
is the same; nothing is copied. Later transformers releases do the same themselves (`pack_gqa`); this
gives every release skyq supports that decode. The copies were a large share of a decode step
(docs/benchmarks.md, the engine's decode at 17-64 rows).

Everything else goes to transformers' own function: more than one query position (prefill, the
trainer's and the engine's scoring), no mask (there transformers asks torch for `enable_gqa`, no copy
either), position biases, soft caps, attention outputs. So the trainer's attention is transformers'
bit for bit, as is the engine's scoring of whole sequences.

On a GPU those calls keep torch's cuDNN attention out of the backends torch may pick
(`MULTI_POSITION_BACKENDS`). torch 2.11 on sm90 tries cuDNN first where its constraints hold (the FP8
recipes' attention inputs do), and cuDNN builds an execution plan for every new (batch, length) it sees,
which made the first step at a new sequence length seconds instead of milliseconds, while torch's
memory-efficient kernel needs no plan and trained as fast at short and long lengths (docs/benchmarks.md,
`benchmarks/train_step.py --new-lengths`). An RL batch's padded length changes from step to
step, so every step would pay it. The trainer and the engine's prefill and scoring all come through
here, so both sides still run the same kernel. The one-token decode keeps cuDNN: its shapes are fixed
per captured decoder (padded batch, rounded cache capacity), so it builds each plan once. torch's
backend switches are process-wide, not per thread: skyq runs a process's attention on one thread.
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

NAME = "skyq_sdpa"
"""The attention implementation name `install` registers and sets on a model that uses `sdpa`."""

MULTI_POSITION_BACKENDS = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)
"""The backends torch may choose from for attention over more than one query position on a GPU, in its
own order of preference: no cuDNN, whose per-shape plans cost seconds at every new sequence length (see
the module docstring). Flash takes the unmasked calls, the memory-efficient kernel the masked ones."""


def multi_position_backends(device: torch.device):
    """The context the multi-position attention runs in: on CUDA, torch's SDPA backends restricted to
    `MULTI_POSITION_BACKENDS` for the call (its backward runs the kernel its forward chose); elsewhere
    nothing changes."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    return sdpa_kernel(list(MULTI_POSITION_BACKENDS))


def _packs(
    module: nn.Module, query: Tensor, key: Tensor, attention_mask: Tensor | None, kwargs: dict
) -> bool:
    groups = getattr(module, "num_key_value_groups", 1)
    return (
        query.shape[2] == 1 and groups > 1 and attention_mask is not None and attention_mask.ndim == 4
        and attention_mask.shape[1] in (1, query.shape[1]) and query.shape[1] == key.shape[1] * groups
        and kwargs.get("position_bias") is None and kwargs.get("softcap") is None
        and not kwargs.get("output_attentions", False)
    )  # fmt: skip


def sdpa_attention_forward(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[Tensor, None]:
    """transformers' attention-function signature: query [B, H, Tq, D], key / value [B, Hkv, T, D],
    mask [B, 1 or H, Tq, T] or None; returns ([B, Tq, H, D], None). One query position with a mask
    and grouped heads: the heads of a group as its query rows (see the module docstring); otherwise
    transformers' `sdpa_attention_forward`."""
    if not _packs(module, query, key, attention_mask, kwargs):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward as stock

        with multi_position_backends(query.device):
            return stock(module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs)
    b, h, _, d = query.shape
    hkv = key.shape[1]
    q = query.reshape(b, hkv, h // hkv, d)
    mask = attention_mask
    if mask.shape[1] != 1:  # one mask row per head: the heads' rows of their group
        mask = mask.reshape(mask.shape[0], hkv, h // hkv, mask.shape[-1])
    out = torch.nn.functional.scaled_dot_product_attention(
        q, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling, is_causal=False
    )
    return out.reshape(out.shape[0], 1, h, value.shape[-1]), None


def register() -> None:
    """Make `NAME` an attention implementation transformers knows, with `sdpa`'s mask (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, sdpa_attention_forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)


def install(model: nn.Module) -> None:
    """A transformers model that attends with `sdpa` attends with `sdpa_attention_forward` instead
    (other implementations, e.g. `eager` or flash, are left as they are)."""
    if getattr(getattr(model, "config", None), "_attn_implementation", None) == "sdpa":
        register()
        model.set_attn_implementation(NAME)
