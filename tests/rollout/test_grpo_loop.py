"""The whole compute loop in one process: trainer -> serialize -> engine -> generate -> reward -> update."""

from __future__ import annotations

import dataclasses
import time

from skyq.rl.batch import FinishReason, Sample, collate
from skyq.rl.tasks import build_task
from skyq.rl.tokenizer import ArithTokenizer
from skyq.rollout.embedded import EmbeddedEngine
from skyq.trainer.native.trainer import NativeTrainer

STEPS = 12
SAMPLING_SEED = 3000
"""The engine's call seeds are SAMPLING_SEED + step. One fixed draw: over call seeds 1000-5000 (step 1000)
the 12 steps took the expected reward from 0.336 to 0.358-0.460 (the 0.387-0.416 of an earlier
sampler), so the bar below (+0.03) is met with a margin at this seed, not at every one. The tiny
checkpoint is trained on the machine that runs the tests, and torch's AVX-512 and AVX2 kernels
differ in the last place, which its warm-up grows into other weights: both kernel sets measured
(start 0.353 / 0.391, +0.084 / +0.087), and the mismatch bounds below hold on both."""


def _expected_reward(trainer: NativeTrainer) -> float:
    """Exact expected reward over all 100 add_mod10 prompts: P(the response is `answer<eos>`)."""
    tok = ArithTokenizer()
    samples = [
        Sample(tok.encode(f"{a}+{b}=", add_bos=True), tok.encode(str((a + b) % 10), add_eos=True), [0.0, 0.0],
               FinishReason.stop)
        for a in range(10) for b in range(10)
    ]  # fmt: skip
    batch = collate(samples, [0.0] * 100, group_size=1, normalize_std=False, pad_token_id=tok.pad_token_id)
    logp = trainer.logprobs(batch.input_ids, batch.attention_mask)
    return float((logp * batch.response_mask).sum(-1).exp().mean())


def test_grpo_loop_raises_the_add_mod10_reward_with_fp8_blockwise(run_cfg, tiny_checkpoint, serialize):
    cfg = run_cfg("fp8_blockwise", lr=5e-3, global_batch_size=256)
    algo = cfg.algorithm
    trainer = NativeTrainer(
        model_cfg=cfg.model, precision_cfg=cfg.precision, algorithm_cfg=algo, micro_batch_size=128,
        optimizer_cfg=dataclasses.replace(cfg.trainer.optimizer, lr_warmup_steps=5),
        checkpoint_path=tiny_checkpoint, seed=0,
    )  # fmt: skip
    engine = EmbeddedEngine(model_cfg=cfg.model, precision_cfg=cfg.precision, seed=0)
    task = build_task(cfg.task, seed=0)
    start, started = _expected_reward(trainer), time.perf_counter()
    mismatches = []
    for step in range(STEPS):
        engine.load_weights(serialize(trainer), version=step)
        prompts = task.prompts(step, algo.global_batch_size // algo.group_size)
        samples = engine.generate(
            [p.token_ids for p in prompts], n=algo.group_size, max_new_tokens=cfg.task.max_response_length,
            temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p, seed=SAMPLING_SEED + step,
        )  # fmt: skip
        rewards = [task.reward(prompts[i // algo.group_size], s.response_ids) for i, s in enumerate(samples)]
        batch = collate(samples, rewards, group_size=algo.group_size, normalize_std=algo.normalize_adv_std,
                        pad_token_id=task.tokenizer.pad_token_id)  # fmt: skip
        mismatches.append(trainer.train_step(batch)["mismatch_mean_abs"])
    end = _expected_reward(trainer)
    print(f"expected reward {start:.3f} -> {end:.3f} in {STEPS} steps ({time.perf_counter() - started:.1f} s); "
          f"mismatch_mean_abs {min(mismatches):.4f}..{max(mismatches):.4f}")  # fmt: skip
    assert end > start + 0.03
    # The train/rollout mismatch stays at quantization noise. Healthy runs (both CPU kernel sets,
    # model.init_seed 0-3): medians <= 0.013 and single-step spikes up to 0.039; an engine left on
    # step 0's weights: 0.09-0.15 at its first stale step, 0.26-1.3 after.
    assert max(mismatches) < 0.06 and sorted(mismatches)[STEPS // 2] < 0.02, mismatches
