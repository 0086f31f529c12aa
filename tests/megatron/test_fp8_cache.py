"""trainer=megatron re-quantizes its FP8 weights every step (`refresh_fp8_weight_caches`).

Transformer Engine is not installed on this CPU machine: a module carrying TE's `is_first_microbatch`
attribute stands in for a TE linear here. The H200 run is the integration check (docs/benchmarks.md).
"""

from __future__ import annotations

import inspect

import torch

from skyq.trainer.megatron import trainer as megatron_trainer


class _TeLike(torch.nn.Linear):
    def __init__(self) -> None:
        super().__init__(4, 4)
        self.is_first_microbatch = False  # what Megatron's TE wrappers leave after a forward


def test_every_te_module_is_told_to_requantize_and_plain_modules_are_left_alone():
    model = torch.nn.Sequential(
        _TeLike(), torch.nn.ReLU(), torch.nn.Sequential(_TeLike(), torch.nn.Linear(4, 4))
    )
    assert megatron_trainer.refresh_fp8_weight_caches(model) == 2
    assert all(m.is_first_microbatch for m in model.modules() if isinstance(m, _TeLike))
    assert not hasattr(model[1], "is_first_microbatch")


def test_train_step_and_logprobs_refresh_before_their_first_forward():
    """Both passes over the current weights start by telling TE to re-quantize them (the order of the
    calls in the source: refresh, then megatron's micro-batch schedule)."""
    for method in (megatron_trainer.MegatronTrainer.train_step, megatron_trainer.MegatronTrainer.logprobs):
        source = inspect.getsource(method)
        assert source.index("refresh_fp8_weight_caches(self.model)") < source.index("self._schedule(")
