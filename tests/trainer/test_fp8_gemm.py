"""`trainer.fp8_gemm`: FP8 blockwise linears of the native trainer as FP8 GEMMs (forward, dgrad,
wgrad). Here on the CPU through the exact fp32 emulation of the same FP8 operands (`emulated`); the
cuBLAS path (`auto` on SM90) multiplies the same operands and is checked against that emulation in
tests/gpu/test_fp8_linear.py."""

from __future__ import annotations

import pytest
import torch

from skyq.config.enums import Fp8Gemm
from skyq.rl.batch import FinishReason, Sample, collate
from skyq.rl.tasks import build_task
from skyq.trainer.native.precision import (
    ActivationQuantExperts,
    ActivationQuantLinear,
    Fp8GemmExperts,
    Fp8GemmLinear,
)
from skyq.trainer.native.trainer import NativeTrainer, resolve_fp8_gemm


def _trainer(run_cfg, tiny_checkpoint, precision: str, fp8_gemm: Fp8Gemm) -> NativeTrainer:
    cfg = run_cfg(precision)
    return NativeTrainer(
        model_cfg=cfg.model, precision_cfg=cfg.precision, optimizer_cfg=cfg.trainer.optimizer,
        algorithm_cfg=cfg.algorithm, micro_batch_size=64, checkpoint_path=tiny_checkpoint, seed=0,
        fp8_gemm=fp8_gemm,
    )  # fmt: skip


def _modules(trainer: NativeTrainer, *types: type) -> list[str]:
    return sorted(n for n, m in trainer.model.named_modules() if isinstance(m, types))


def _batch(run_cfg, n: int = 32):
    task = build_task(run_cfg().task, seed=0)
    gen = torch.Generator().manual_seed(0)
    samples = []
    for p in task.prompts(0, n):
        response = torch.randint(2, 12, (3,), generator=gen).tolist()
        samples.append(
            Sample(prompt_ids=p.token_ids, response_ids=response, logprobs=[-1.0] * 3,
                   finish_reason=FinishReason.length)
        )  # fmt: skip
    rewards = [float(i % 2) for i in range(n)]
    return collate(samples, rewards, group_size=4, normalize_std=False, pad_token_id=0)


def test_the_device_decides_auto_and_emulated_forces_the_gemm_path():
    cpu = torch.device("cpu")
    assert resolve_fp8_gemm(Fp8Gemm.off, cpu) is None
    assert resolve_fp8_gemm(Fp8Gemm.auto, cpu) is None  # no blockwise cuBLAS here: fake quant
    assert resolve_fp8_gemm(Fp8Gemm.emulated, cpu) is True


def test_emulated_rewrites_exactly_the_fake_quant_modules(run_cfg, tiny_checkpoint):
    fake = _trainer(run_cfg, tiny_checkpoint, "fp8_blockwise", Fp8Gemm.off)
    gemm = _trainer(run_cfg, tiny_checkpoint, "fp8_blockwise", Fp8Gemm.emulated)
    assert gemm.activation_quantized == fake.activation_quantized
    assert _modules(gemm, Fp8GemmLinear, Fp8GemmExperts) == _modules(
        fake, ActivationQuantLinear, ActivationQuantExperts
    )
    assert _modules(gemm, ActivationQuantLinear, ActivationQuantExperts) == []
    assert list(gemm.state_dict()["model"]) == list(fake.state_dict()["model"])  # same parameter names


@pytest.mark.parametrize("precision", ["mxfp8", "int4_qat", "bf16"])
def test_other_precisions_keep_their_path(run_cfg, tiny_checkpoint, precision):
    trainer = _trainer(run_cfg, tiny_checkpoint, precision, Fp8Gemm.emulated)
    assert _modules(trainer, Fp8GemmLinear, Fp8GemmExperts) == []


def test_fp8_gemm_forward_matches_fake_quant_and_trains(run_cfg, tiny_checkpoint):
    """Same weights and input codes; the GEMM path rounds its operands through bf16 and its output
    to bf16, so log-probs agree to bf16 accuracy. A train step then moves every master weight.

    The bounds hold on any CPU: the tiny checkpoint is trained on the machine that runs the tests,
    and torch's AVX-512 and AVX2 kernels (softmax, reductions) differ in the last place, which the
    warm-up grows into different weights. Measured on both kernel sets over 16 batches: mean
    |diff| 0.011-0.036 and at most 2 of 96 tokens above 0.3, the largest 0.65 (one token whose
    difference grows through both layers); activation scales applied to the wrong rows give a mean
    of 0.50-0.75 with 44-54 tokens above 0.3."""
    batch = _batch(run_cfg)
    fake = _trainer(run_cfg, tiny_checkpoint, "fp8_blockwise", Fp8Gemm.off)
    gemm = _trainer(run_cfg, tiny_checkpoint, "fp8_blockwise", Fp8Gemm.emulated)
    mask = batch.response_mask.bool()
    lp_fake = fake.logprobs(batch.input_ids, batch.attention_mask)[mask]
    lp_gemm = gemm.logprobs(batch.input_ids, batch.attention_mask)[mask]
    diff = (lp_fake - lp_gemm).abs()
    summary = (float(diff.mean()), float(diff.max()), int((diff > 0.3).sum()))
    assert summary[0] < 0.04 and summary[1] < 1.0 and summary[2] <= 3, summary
    assert float(diff.max()) > 0  # the GEMM path really ran (bf16 operands differ from fp32 ones)

    before = {n: p.detach().clone() for n, p in gemm.model.named_parameters()}
    metrics = gemm.train_step(batch)
    assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values())
    moved = [n for n, p in gemm.model.named_parameters() if not torch.equal(before[n], p.detach())]
    quantized = {n for n in before if "experts" in n or "proj" in n}
    assert quantized <= set(moved), sorted(quantized - set(moved))[:5]


def test_linears_reading_one_activation_share_its_quantization(monkeypatch):
    """q/k/v read one normed input: one two-orientation quantization pass for all three (counted),
    the same outputs and gradients, bit for bit, as three passes over separate copies of it; an
    in-place write to the input, or a new input, quantizes again."""
    from skyq.trainer import fp8_linear

    calls = []
    real = fp8_linear.quantize_rows_cols
    monkeypatch.setattr(fp8_linear, "quantize_rows_cols", lambda x: calls.append(x.shape) or real(x))
    gen = torch.Generator().manual_seed(0)
    ws = [
        (torch.randn(n, 256, generator=gen) * 0.05).to(torch.bfloat16).requires_grad_()
        for n in (256, 128, 128)
    ]
    x0 = torch.randn(3, 40, 256, generator=gen).to(torch.bfloat16)

    def run(shared: bool, passes: int):
        base = x0.clone().requires_grad_()
        h = base * 1  # a non-leaf activation, as a norm's output is
        ins = [h] * 3 if shared else [h.clone() for _ in ws]
        calls.clear()
        outs = [fp8_linear.fp8_blockwise_linear(x, w, emulate=True) for x, w in zip(ins, ws)]
        assert len(calls) == passes  # the forward's activation passes
        sum((o.float() ** 2).sum() for o in outs).backward()
        return outs, base.grad, [w.grad.clone() for w in ws]

    separate = run(shared=False, passes=3)
    for w in ws:
        w.grad = None
    shared = run(shared=True, passes=1)
    for a, b in zip(separate[0], shared[0]):
        assert torch.equal(a, b)
    assert torch.equal(separate[1], shared[1])
    for a, b in zip(separate[2], shared[2]):
        assert torch.equal(a, b)

    calls.clear()
    with torch.no_grad():
        h = x0.clone()
        fp8_linear.fp8_blockwise_linear(h, ws[0].detach(), emulate=True)
        h.add_(1)  # in place: the next consumer must not see the old codes
        y = fp8_linear.fp8_blockwise_linear(h, ws[1].detach(), emulate=True)
        want = fp8_linear.fp8_blockwise_linear(h.clone(), ws[1].detach(), emulate=True)
    assert torch.equal(y, want)
    del h
    assert fp8_linear._last_activation._ref is None  # the entry died with its tensor
    with torch.inference_mode():  # inference tensors have no version counter: computed, not shared
        h = x0.clone()
        ys = [fp8_linear.fp8_blockwise_linear(h, w.detach(), emulate=True) for w in ws[:2]]
    with torch.no_grad():
        assert torch.equal(ys[1], fp8_linear.fp8_blockwise_linear(x0.clone(), ws[1].detach(), emulate=True))
