"""`topology=1gpu` on a GPU: the trainer and the engine in one process on the device. With FP8
blockwise or bf16 weights the trainer's log-probs of sampled sequences equal the engine's teacher-forced
ones bit for bit, as on the CPU (test_local_pair.py): every op before a quantizer, skyq's RMSNorm
included, computes the same bits on both sides."""

from __future__ import annotations

import pytest
import torch

from skyq.ops.rmsnorm import RMSNorm

from .run_helpers import compose_config
from .test_local_pair import _pair, _score_both_sides

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("precision", ["fp8_blockwise", "bf16", "int4_qat", "mxfp8"])
def test_trainer_scores_exactly_what_the_engine_computes_on_the_gpu(base_overrides, monkeypatch, precision):
    """The trainer runs its routed experts as grouped GEMMs on the GPU (`grouped_forward`, the
    engine prefill's formulation: FP8's and MXFP8's `ActivationQuantExperts`, and bf16's / INT4's
    `RoutedExperts` in place of transformers' own experts; the engine's INT4 and MXFP8 experts grouped
    outside decode steps) and scores the engine's bits."""
    from skyq.rollout.quantized_linear import WireExperts
    from skyq.trainer.native.precision import ActivationQuantExperts, RoutedExperts

    experts = ActivationQuantExperts if precision in ("fp8_blockwise", "mxfp8") else RoutedExperts
    grouped, engine_grouped = [], []
    real, real_engine = experts.grouped_forward, WireExperts._grouped_forward
    monkeypatch.setattr(experts, "grouped_forward", lambda *a: grouped.append(1) or real(*a))
    monkeypatch.setattr(
        WireExperts, "_grouped_forward", lambda *a: engine_grouped.append(1) or real_engine(*a)
    )
    overrides = [*base_overrides, "topology=1gpu", f"precision={precision}"]
    if precision == "mxfp8":
        overrides.append("precision.emulate=true")  # MXFP8 GEMMs need sm_100; the H200 emulates them
    cfg, _ = compose_config(overrides)
    pair = _pair(overrides)
    try:
        for model in (pair.trainer.trainer.model, pair.engine.engine.model):
            norms = [m for m in model.modules() if "RMSNorm" in type(m).__name__]
            assert norms and all(type(m) is RMSNorm for m in norms)
            assert next(model.parameters()).is_cuda
        assert pair.trainer.trainer.optimizer.defaults["fused"]  # one fused AdamW pass on the GPU
        trainer, engine, mask = _score_both_sides(pair, cfg)
    finally:
        pair.shutdown()
    assert mask.sum() > 0 and grouped and engine_grouped
    assert torch.equal(trainer[mask].cpu(), engine[mask].cpu())
