"""skyq's dummy-weight boot: vLLM's dummy loader, without its fill of the attention layers' own tensors.

vLLM's `DummyModelLoader` fills every floating-point tensor it finds with random values (re-seeded per
tensor, so every scalar gets the same number), the attention layers' KV-cache scales included: the
`_q_scale` / `_k_scale` / `_v_scale` / `_prob_scale` buffers every attention layer registers (1.0) and
the `q/k/v(/prob)_scale` (and compressed-tensors' zero-point) parameters a quantization config's
KV-cache method creates (sentinels a checkpoint without KV-cache scales leaves alone). Processing after
loading derives the scales the attention kernels read from them (vLLM 0.26, compressed-tensors: the
`_k/_v/_q_scale` become the `k/v/q_scale` parameters; vLLM 0.26 and 0.32, FP8 with a bf16 KV cache:
`_k/_v_scale` keep the dummy value). No checkpoint skyq writes has KV-cache scales, so no sync
overwrites them: a dummy-booted engine would differ from a fresh boot for good, and with an FP8 KV
cache it would quantize with a random scale.

`SkyqDummyModelLoader` (load format `compat.DUMMY_LOAD_FORMAT`) puts the attention layers' own tensors
back to their creation values after vLLM's fill, before processing, so processing derives exactly what
a boot from a checkpoint without KV-cache scales derives (tests/vllm/test_fp8_engine.py,
tests/gpu/test_vllm_int4_gpu.py). Registered on import; vLLM imports the worker extension, which
imports this, in every worker process before the model loads.
"""

from __future__ import annotations

import torch
from torch import nn
from vllm.model_executor.model_loader import register_model_loader
from vllm.model_executor.model_loader.dummy_loader import DummyModelLoader

from skyq.rollout.vllm.compat import DUMMY_LOAD_FORMAT, is_deferred_attention_layer


def attention_tensors(model: nn.Module) -> list[torch.Tensor]:
    """The attention layers' own parameters and persistent buffers (their KV-cache scales), the
    tensors a checkpoint without KV-cache scales leaves at their creation values."""
    tensors = []
    for layer in model.modules():
        if not is_deferred_attention_layer(layer):
            continue
        tensors += [p for p in layer.parameters(recurse=False) if not p.is_meta]
        tensors += [
            b
            for name, b in layer.named_buffers(recurse=False)
            if name not in layer._non_persistent_buffers_set and not b.is_meta
        ]
    return tensors


@register_model_loader(DUMMY_LOAD_FORMAT)
class SkyqDummyModelLoader(DummyModelLoader):
    """vLLM's dummy loader, leaving the attention layers' own tensors at their creation values."""

    @torch.no_grad()
    def load_weights(self, model: nn.Module, model_config) -> None:
        kept = [(tensor, tensor.clone()) for tensor in attention_tensors(model)]
        super().load_weights(model, model_config)
        for tensor, value in kept:
            tensor.copy_(value)
