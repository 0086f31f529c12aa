"""NativeTrainer: HF weights, log-probs, GRPO steps, checkpointing."""

from __future__ import annotations

import pytest
import torch

from skyq.quant.kernels import dispatch
from skyq.rl.batch import FinishReason, Sample, collate
from skyq.rl.grpo import policy_loss
from skyq.trainer.native.model import load_model
from skyq.trainer.native.precision import _StraightThrough
from skyq.trainer.native.trainer import TrainerStateError, token_logprobs


def _batch(seed: int = 0, rows: int = 16):
    """A random rollout batch: groups of 4 responses with random rewards and rollout log-probs."""
    gen = torch.Generator().manual_seed(seed)
    samples, rewards = [], []
    for r in range(rows):
        prompt = [1, 3 + r % 10, 13, 3 + (r * 7) % 10, 18]
        length = 1 + int(torch.randint(0, 3, (1,), generator=gen))
        response = torch.randint(3, 13, (length,), generator=gen).tolist()
        samples.append(
            Sample(prompt, response, (-torch.rand(length, generator=gen) * 3).tolist(), FinishReason.length)
        )
        rewards.append(float(torch.randint(0, 2, (1,), generator=gen)))
    return collate(samples, rewards, group_size=4, normalize_std=True, pad_token_id=0)


def test_hf_weights_follow_the_layout_in_bf16(make_trainer):
    trainer = make_trainer()
    specs = trainer.layout.hf_parameters(trainer.model_cfg)
    weights = list(trainer.hf_weights())
    assert [(n, tuple(t.shape)) for n, t in weights] == [(s.name, s.shape) for s in specs]
    assert all(t.dtype == torch.bfloat16 and t.is_contiguous() for _, t in weights)
    by_name = dict(weights)
    fused = dict(trainer.model.named_parameters())["model.layers.1.mlp.experts.gate_up_proj"]
    i = trainer.model_cfg.moe_intermediate_size
    assert torch.equal(
        by_name["model.layers.1.mlp.experts.2.up_proj.weight"], fused[2, i:].to(torch.bfloat16)
    )


def test_hf_weight_items_hold_the_hf_weights_with_experts_stacked_per_projection(make_trainer):
    trainer = make_trainer()
    cfg = trainer.model_cfg
    flat, stacks = {}, []
    for name, tensor in trainer.hf_weight_items():
        if isinstance(name, str):
            flat[name] = tensor
            continue
        stacks.append(name)
        assert tensor.shape[0] == len(name) == cfg.num_experts and tensor.is_contiguous()
        flat.update(zip(name, tensor.unbind(0)))
    projections = ("gate_proj", "up_proj", "down_proj")
    assert sorted(stacks) == sorted(
        tuple(f"model.layers.{layer}.mlp.experts.{e}.{p}.weight" for e in range(cfg.num_experts))
        for layer in range(cfg.num_layers)
        for p in projections
    )
    weights = dict(trainer.hf_weights())
    assert list(flat) == list(dict.fromkeys(flat)) and set(flat) == set(weights)
    for name, tensor in weights.items():
        assert flat[name].dtype == tensor.dtype and torch.equal(flat[name], tensor), name


def test_logprobs_are_token_aligned_log_softmax(make_trainer):
    trainer = make_trainer("bf16")
    batch = _batch()
    logp = trainer.logprobs(batch.input_ids, batch.attention_mask)
    assert logp.shape == batch.input_ids.shape and torch.all(logp[:, 0] == 0) and torch.all(logp <= 0)
    row = batch.input_ids[:1, :4]
    logits = trainer._forward(trainer.effective_parameters())(input_ids=row).logits
    manual = torch.log_softmax(logits[0, 2].float(), -1)[row[0, 3]]
    torch.testing.assert_close(logp[0, 3], manual.detach())


def test_train_step_updates_weights_and_reports_metrics(make_trainer):
    trainer = make_trainer()
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    metrics = trainer.train_step(_batch())
    expected = {"loss", "pg_loss", "grad_norm", "lr", "clip_frac", "is_weight_mean", "is_truncated_frac",
                "is_masked_frac", "mismatch_mean_abs", "mismatch_k3", "mismatch_max", "reward_mean"}  # fmt: skip
    assert expected <= set(metrics)
    assert all(isinstance(v, float) for v in metrics.values())
    assert metrics["grad_norm"] > 0 and metrics["lr"] == trainer.algorithm_cfg.lr and trainer.step == 1
    assert metrics["mismatch_mean_abs"] > 0.1  # the random "rollout" log-probs are far from the model's
    changed = [n for n, p in trainer.model.named_parameters() if not torch.equal(p, before[n])]
    assert len(changed) == len(before)


def test_micro_batching_does_not_change_the_gradient(make_trainer):
    # bf16: FP8 activation rounding would amplify the fp32 last-bit differences of other GEMM shapes
    a, b = make_trainer("bf16", micro_batch_size=16), make_trainer("bf16", micro_batch_size=3)
    for trainer in (a, b):  # compare the clipped gradients the optimizer would apply
        trainer.optimizer.step = lambda: None
    batch = _batch(seed=1)
    ma, mb = a.train_step(batch), b.train_step(batch)
    assert ma["loss"] == pytest.approx(mb["loss"], rel=1e-5, abs=1e-7)
    assert ma["grad_norm"] == pytest.approx(mb["grad_norm"], rel=1e-5)
    for (name, pa), (_, pb) in zip(a.model.named_parameters(), b.model.named_parameters()):
        torch.testing.assert_close(pa.grad, pb.grad, rtol=1e-4, atol=1e-7, msg=name)


def _fp32_effective_weights(trainer) -> dict[str, torch.Tensor]:
    """Every master rounded to bf16 and fake-quantized, held in fp32 with a straight-through
    gradient: what the forward computed on (cast to the compute dtype) before the step quantized
    once and in the compute dtype."""
    out = {}
    for name, master in trainer.model.named_parameters():
        with torch.no_grad():
            value = trainer.strategy.fake_quant_param(
                name, master.detach().to(torch.bfloat16), layout=trainer.layout, model_cfg=trainer.model_cfg
            ).float()
        out[name] = _StraightThrough.apply(master, value)
    return out


def _per_micro_batch_gradients(trainer, batch) -> dict[str, torch.Tensor]:
    """The master gradients of a step computed the straightforward way: every micro-batch forward on
    freshly computed fp32 effective weights cast to the compute dtype, each backward straight through
    them to the master."""
    trainer.model.train()
    trainer.optimizer.zero_grad(set_to_none=True)
    num_tokens = float(batch.response_mask.sum())
    with dispatch.deferred_finite_checks():
        for start in range(0, len(batch), trainer.micro_batch_size):
            micro = batch.slice(start, start + trainer.micro_batch_size)
            forward = trainer._forward(_fp32_effective_weights(trainer))
            logp = token_logprobs(
                forward, micro.input_ids, micro.attention_mask, temperature=trainer.temperature
            )
            ref = None
            if trainer.ref_params is not None:
                with torch.no_grad():
                    ref = token_logprobs(trainer._forward(trainer.ref_params), micro.input_ids,
                                         micro.attention_mask, temperature=trainer.temperature)  # fmt: skip
            loss, _ = policy_loss(
                logp, logp.detach(), micro.rollout_logprobs, micro.advantages, micro.response_mask,
                ref_logp=ref, loss_normalizer=num_tokens, **trainer._loss_kwargs(),
            )  # fmt: skip
            loss.backward()
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters()}
    trainer.optimizer.zero_grad(set_to_none=True)
    return grads


@pytest.mark.parametrize(
    ("precision", "compute", "kl_coef", "micro"),
    [("fp8_blockwise", torch.float32, 0.0, 3), ("fp8_blockwise", torch.bfloat16, 0.1, 3),
     ("fp8_blockwise", torch.bfloat16, 0.0, 16), ("int4_qat", torch.bfloat16, 0.0, 3),
     ("mxfp8", torch.bfloat16, 0.0, 5), ("bf16", torch.float32, 0.0, 3), ("bf16", torch.bfloat16, 0.0, 16)],
)  # fmt: skip
def test_weights_quantized_once_a_step_give_the_per_micro_batch_gradients_bit_for_bit(
    make_trainer, precision, compute, kl_coef, micro
):
    """The step computes the effective (fake-quantized) weights once, in the compute dtype, and
    sums the micro-batches' gradients in fp32 on detached leaves (one micro-batch: backward straight
    through): every master gradient equals, bit for bit, the per-micro-batch backward through
    freshly quantized fp32 weights cast to the compute dtype."""
    trainer = make_trainer(precision, micro_batch_size=micro, kl_coef=kl_coef)
    trainer.compute_dtype = compute
    batch = _batch(seed=4)
    want = _per_micro_batch_gradients(trainer, batch)
    trainer.optimizer.step = lambda: None  # keep the weights: compare the gradients of this step
    trainer.optimizer_cfg.grad_clip = float("inf")
    trainer.train_step(batch)
    for name, p in trainer.model.named_parameters():
        assert p.grad is not None and torch.equal(p.grad, want[name]), name


def test_kl_term_uses_the_starting_policy_as_reference(make_trainer):
    trainer = make_trainer(kl_coef=0.1)
    first = trainer.train_step(_batch())
    assert first["kl"] == pytest.approx(0.0, abs=1e-9)  # policy == reference before any update
    assert trainer.train_step(_batch(seed=2))["kl"] > 0


def test_state_dict_round_trip_resumes_identically(make_trainer):
    a = make_trainer()
    a.train_step(_batch(seed=3))
    state = a.state_dict()
    b = make_trainer()
    b.load_state_dict(state)
    assert b.step == 1
    a.train_step(_batch(seed=4))
    b.train_step(_batch(seed=4))
    for (name, pa), (_, pb) in zip(a.model.named_parameters(), b.model.named_parameters()):
        assert torch.equal(pa, pb), name


def test_load_state_dict_refuses_a_foreign_state(make_trainer):
    trainer = make_trainer()
    state = trainer.state_dict()
    del state["model"]["lm_head.weight"]
    with pytest.raises(TrainerStateError, match="lm_head.weight"):
        trainer.load_state_dict(state)
    with pytest.raises(TrainerStateError, match="'optimizer'"):
        trainer.load_state_dict({"model": {}, "step": 0})


def test_save_hf_writes_a_checkpoint_that_loads_back(make_trainer, tmp_path):
    trainer = make_trainer()
    trainer.train_step(_batch())
    trainer.save_hf(tmp_path / "hf")
    reloaded = load_model(tmp_path / "hf", trainer.model_cfg)
    for name, param in reloaded.named_parameters():
        assert torch.equal(
            param, dict(trainer.model.named_parameters())[name].detach().to(torch.bfloat16).float()
        )
