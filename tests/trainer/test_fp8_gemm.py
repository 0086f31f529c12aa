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
    to bf16, so log-probs agree to bf16 accuracy. A train step then moves every master weight."""
    batch = _batch(run_cfg)
    fake = _trainer(run_cfg, tiny_checkpoint, "fp8_blockwise", Fp8Gemm.off)
    gemm = _trainer(run_cfg, tiny_checkpoint, "fp8_blockwise", Fp8Gemm.emulated)
    mask = batch.response_mask.bool()
    lp_fake = fake.logprobs(batch.input_ids, batch.attention_mask)[mask]
    lp_gemm = gemm.logprobs(batch.input_ids, batch.attention_mask)[mask]
    diff = (lp_fake - lp_gemm).abs()
    assert float(diff.mean()) < 0.04 and float(diff.max()) < 0.3, (float(diff.mean()), float(diff.max()))
    assert float(diff.max()) > 0  # the GEMM path really ran (bf16 operands differ from fp32 ones)

    before = {n: p.detach().clone() for n, p in gemm.model.named_parameters()}
    metrics = gemm.train_step(batch)
    assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values())
    moved = [n for n, p in gemm.model.named_parameters() if not torch.equal(before[n], p.detach())]
    quantized = {n for n in before if "experts" in n or "proj" in n}
    assert quantized <= set(moved), sorted(quantized - set(moved))[:5]
