"""The embedded engine on the GPU with a routed-experts model: its FP8 experts stacked, decode-sized
forwards through grouped launches (needs the config stack, hydra, for the run config)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("hydra")

from native_fixtures import _one_thread, make_trainer, run_cfg, tiny_checkpoint  # noqa: E402, F401

from skyq.rollout import quantized_linear  # noqa: E402
from skyq.rollout.quantized_linear import WireExperts  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _loaded_engine(request, precision):
    """(engine on the GPU holding a tiny trainer's serialized weights, the run config)."""
    from skyq.rollout.embedded import EmbeddedEngine

    trainer = request.getfixturevalue("make_trainer")(precision)
    cfg = request.getfixturevalue("run_cfg")(precision)
    engine = EmbeddedEngine(model_cfg=cfg.model, precision_cfg=cfg.precision, seed=0, device="cuda")
    wire = {}
    for name, tensor in trainer.hf_weights():
        wire.update(
            trainer.strategy.serialize(name, tensor, role=trainer.layout.role(name, trainer.model_cfg))
        )
    engine.load_weights(wire, version=0)
    return engine, cfg


@pytest.mark.parametrize("precision", ["fp8_blockwise", "bf16"])
def test_engine_scores_moe_decode_rows_through_grouped_launches(request, monkeypatch, precision):
    """The engine on the GPU stacks its FP8 (or bf16) experts; a forward of <= DECODE_MAX_ROWS rows runs each
    projection of the experts as one grouped launch (gate and up one together where stacked together) and scores as the per-expert loop does (the
    loop with the stacks dropped), within the kernels' rounding; repeated calls give the same bits."""
    engine, cfg = _loaded_engine(request, precision)
    experts = [m for m in engine.model.modules() if isinstance(m, WireExperts)]
    assert experts and all(m.stacked for m in experts)
    ids = torch.randint(0, cfg.model.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    calls = []
    owner, name = (quantized_linear, "bf16_grouped_linear")
    if precision == "fp8_blockwise":
        owner, name = quantized_linear.fp8_linear, "fp8_grouped_weight_only_linear"
    grouped_fn = getattr(owner, name)
    monkeypatch.setattr(owner, name, lambda *a, **k: calls.append(1) or grouped_fn(*a, **k))
    fused = []
    silu_mul = quantized_linear.silu_mul
    monkeypatch.setattr(quantized_linear, "silu_mul", lambda *a: fused.append(1) or silu_mul(*a))
    # gate and up share one launch where they share one stack (bf16 here; FP8 needs whole scale blocks)
    launches = sum(2 if "gate_up_proj" in m.stacked else 3 for m in experts)
    grouped = engine.score(ids, mask)
    assert len(calls) == launches
    assert len(fused) == len(experts)  # silu(gate) * up in one launch a layer
    assert torch.equal(engine.score(ids, mask), grouped)
    for m in experts:
        m.stacked = {}
    loop = engine.score(ids, mask)
    assert len(calls) == 2 * launches  # the loop made no grouped call
    assert float((grouped - loop).abs().max()) < 5e-2


@pytest.mark.parametrize("precision", ["fp8_blockwise", "bf16", "int4_qat", "mxfp8"])
def test_engine_prefill_runs_the_experts_as_grouped_gemms(request, monkeypatch, precision):
    """A forward of more tokens than a decode (prefill, scoring) on the GPU also groups the experts:
    bf16 stacks and FP8 / INT4 / MXFP8 stacks dequantized once go through torch._grouped_mm, no
    per-expert loop; it scores as the loop does within bf16 rounding."""
    engine, cfg = _loaded_engine(request, precision)
    experts = [m for m in engine.model.modules() if isinstance(m, WireExperts)]
    ids = torch.randint(0, cfg.model.vocab_size, (4, 40), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    calls = []
    real = quantized_linear.bf16_grouped_linear
    monkeypatch.setattr(quantized_linear, "bf16_grouped_linear", lambda *a: calls.append(1) or real(*a))
    grouped = engine.score(ids, mask)
    assert len(calls) == 3 * len(experts)
    for m in experts:
        m.stacked = {}
    loop = engine.score(ids, mask)
    assert len(calls) == 3 * len(experts)
    assert float((grouped - loop).abs().max()) < 5e-2


@pytest.mark.parametrize(("t", "k", "experts", "h"), [(1, 4, 32, 1024), (64, 8, 128, 2048), (37, 6, 20, 513)])
def test_combine_kernel_is_the_ordered_bf16_sum_bit_for_bit(t, k, experts, h):
    """The one-launch recombination of routed rows equals the torch reference (k gathers and k bf16
    adds in ascending expert order) bit for bit on the GPU."""
    from skyq.ops.moe_combine import combine, combine_reference
    from tests.ops.test_moe_combine import routed_rows

    gen = torch.Generator().manual_seed(t * 1000 + k)
    down, order, idx, w = (a.cuda() for a in routed_rows(gen, t, k, experts, h, torch.bfloat16))
    assert torch.equal(
        combine(down, order, idx, w, torch.bfloat16), combine_reference(down, order, idx, w, torch.bfloat16)
    )
