"""The embedded engine serving the tiny Kimi-K2.6 with its vision tower (`model=tiny_kimi_vl`): the
accounted sync carries the tower and projector (bf16 on the wire in every precision, a sync without one
refused), a prompt's images go into the prefill and come back with its samples, and the trainer, given
the same images, scores the engine's samples as the engine did."""

from __future__ import annotations

import pytest
import torch
from native_fixtures import sync_in_process

from skyq.launch.actors import EngineWorker, TrainerWorker
from skyq.quant.layouts import vision
from skyq.rl.batch import collate
from skyq.rl.grpo import mismatch_metrics
from skyq.sync.errors import SyncRefused

PROJECTOR_OUT = "mm_projector.proj.2.weight"


@pytest.mark.parametrize("precision", ["bf16", "int4_qat"])
def test_the_sync_carries_the_tower_and_projector_in_bf16(vl_cfg, dots_dir, precision):
    cfg = vl_cfg(precision)
    trainer = TrainerWorker(
        model_cfg=cfg.model, precision_cfg=cfg.precision, optimizer_cfg=cfg.trainer.optimizer,
        algorithm_cfg=cfg.algorithm, micro_batch_size=64, checkpoint_path=str(dots_dir / "checkpoint"),
        device="cpu", seed=0, temperature=1.0,
    )  # fmt: skip
    engine = EngineWorker(
        model_cfg=cfg.model, precision_cfg=cfg.precision, device="cpu", seed=0, eos_token_id=2
    )
    assert sync_in_process(trainer, engine, 1) == (None, None)
    digest = engine.wire_digest()
    assert digest == trainer.serialized_digest() and engine.engine.weight_version == 1
    towers = {name: d for name, d in digest.items() if vision.is_vision_name(name)}
    assert len(towers) == len(vision.vision_names(cfg.model)) and {d[0] for d in towers.values()} == {
        "bfloat16"
    }
    held = engine.engine.model.get_parameter(PROJECTOR_OUT)
    assert torch.equal(held, dict(trainer.trainer.hf_weights())[PROJECTOR_OUT])
    # a sync that drops a projector tensor is refused by the accounting; the engine keeps version 1
    dropped = [(n, t) for n, t in trainer.trainer.hf_weights() if n != PROJECTOR_OUT]
    send_err, recv_err = sync_in_process(trainer, engine, 2, weights=dropped)
    for err in (send_err, recv_err):
        assert isinstance(err, SyncRefused) and f"`{PROJECTOR_OUT}` was dropped" in str(err), err
    assert engine.engine.weight_version == 1 and engine.wire_digest() == digest


@pytest.mark.parametrize("precision", ["bf16", "int4_qat"])
def test_images_reach_the_prefill_and_the_trainer_scores_the_samples_as_the_engine(
    make_vl_trainer, make_vl_engine, vl_prompts, precision
):
    trainer, engine = make_vl_trainer(precision), make_vl_engine(precision)
    engine.load_weights(_serialized(trainer), version=1)
    prompts, _ = vl_prompts(6)
    samples = engine.generate(prompts, n=4, max_new_tokens=3, temperature=1.0, top_p=1.0, seed=0)
    assert [s.images for s in samples] == [p.images for p in prompts for _ in range(4)]
    batch = collate(samples, [0.0] * len(samples), group_size=4, normalize_std=False, pad_token_id=2)
    given = mismatch_metrics(
        trainer.logprobs(batch.input_ids, batch.attention_mask, batch.images), batch.rollout_logprobs,
        batch.response_mask,
    )  # fmt: skip
    assert given["mismatch_mean_abs"] < 0.01 and given["mismatch_max"] < 0.1, given
    mask = batch.response_mask.bool()
    scored = engine.score(batch.input_ids, batch.attention_mask, images=batch.images)
    assert float((scored[mask] - batch.rollout_logprobs[mask]).abs().max()) < 0.05
    # the images made the difference: scored without them the samples are another policy's
    blind = mismatch_metrics(
        trainer.logprobs(batch.input_ids, batch.attention_mask), batch.rollout_logprobs, batch.response_mask
    )
    assert blind["mismatch_mean_abs"] > 10 * given["mismatch_mean_abs"], (blind, given)


def test_a_prompt_with_images_on_a_text_model_is_refused(make_vl_engine, vl_prompts, run_cfg):
    from skyq.rollout.embedded import EmbeddedEngine

    cfg = run_cfg("bf16")
    engine = EmbeddedEngine(model_cfg=cfg.model, precision_cfg=cfg.precision, seed=0)
    engine._version = 1  # the check comes before any weight is read
    prompts, _ = vl_prompts(1)
    with pytest.raises(
        ValueError, match="a prompt with images given to model=tiny_moe, which has no vision tower"
    ):
        engine.generate(prompts, n=1, max_new_tokens=1, temperature=1.0, top_p=1.0, seed=0)


def _serialized(trainer) -> dict[str, torch.Tensor]:
    wire: dict[str, torch.Tensor] = {}
    for name, tensor in trainer.hf_weights():
        wire.update(
            trainer.strategy.serialize(name, tensor, role=trainer.layout.role(name, trainer.model_cfg))
        )
    return wire
