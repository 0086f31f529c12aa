"""The sync between the real trainer and the real embedded engine (in one process, in-process
transport): the engine ends up holding exactly what the strategy serialized from the trainer's
weights, and every bad sync leaves the engine's weights and version untouched."""

from __future__ import annotations

import re

import pytest
import torch
from native_fixtures import sync_in_process

from skyq.launch.actors import EngineWorker, TrainerWorker
from skyq.rl.tokenizer import EOS_ID
from skyq.sync.errors import SyncError, SyncRefused
from skyq.sync.plan_wire import wire_digest
from skyq.sync.sender import build_units

from .run_helpers import compose_config

PRECISIONS = ["bf16", "fp8_blockwise", "mxfp8", "int4_qat"]


def build_workers(overrides: list[str]) -> tuple[TrainerWorker, EngineWorker]:
    from skyq.trainer.native.tiny_checkpoint import ensure_tiny_checkpoint

    cfg, _ = compose_config(overrides)
    path = ensure_tiny_checkpoint(cfg.model, cfg.task, cache_dir=cfg.checkpoint.cache_dir)
    trainer = TrainerWorker(
        model_cfg=cfg.model,
        precision_cfg=cfg.precision,
        optimizer_cfg=cfg.trainer.optimizer,
        algorithm_cfg=cfg.algorithm,
        micro_batch_size=cfg.trainer.micro_batch_size,
        checkpoint_path=str(path),
        device="cpu",
        seed=cfg.seed,
        temperature=cfg.rollout.temperature,
    )
    engine = EngineWorker(
        model_cfg=cfg.model, precision_cfg=cfg.precision, device="cpu", seed=cfg.seed, eos_token_id=EOS_ID
    )
    return trainer, engine


def sync(trainer, engine, version, *, serialize=None, weights=None, corrupt_bucket=None, timeout_s=10.0):
    """Trainer -> engine over the in-process transport; returns (sender error, receiver error).
    `corrupt_bucket`: flip a bit in that bucket's frame on its way."""

    def corrupt(send_end) -> None:
        sent = []

        def corrupting(original):
            def send(payload):
                if len(sent) == corrupt_bucket + 1:  # frame 0 is the manifest
                    payload = payload.clone()
                    payload[payload.numel() // 3] ^= 0x04
                sent.append(1)
                original(payload)

            return send

        # the manifest is sent, the buckets are handed over (`give_frame`): a flip in either
        send_end.send_frame = corrupting(send_end.send_frame)
        send_end.give_frame = corrupting(send_end.give_frame)

    return sync_in_process(
        trainer, engine, version, weights, serialize=serialize, timeout_s=timeout_s,
        prepare=None if corrupt_bucket is None else corrupt,
    )  # fmt: skip


@pytest.mark.parametrize("precision", PRECISIONS)
def test_stacked_expert_items_put_the_same_wire_as_one_tensor_at_a_time(base_overrides, precision):
    trainer, _ = build_workers([*base_overrides, f"precision={precision}"])
    stacked, _, _ = build_units(trainer.trainer.hf_weight_items(), trainer.serialize, 1)
    single, _, _ = build_units(trainer.trainer.hf_weights(), trainer.serialize, 1)
    assert any(not isinstance(n, str) for n, _ in trainer.trainer.hf_weight_items())

    def wire_of(units):
        return {u.source: wire_digest(u.tensors) for u in units}

    assert wire_of(stacked) == wire_of(single)
    assert len(stacked) == len(single)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_engine_holds_bit_for_bit_what_the_strategy_serialized(base_overrides, precision):
    trainer, engine = build_workers([*base_overrides, f"precision={precision}"])
    assert sync(trainer, engine, 1) == (None, None)
    first = engine.wire_digest()
    assert first == trainer.serialized_digest()
    assert engine.engine.weight_version == 1
    # Change the trainer's weights; the next sync must carry the change, bit for bit.
    with torch.no_grad():
        for p in trainer.trainer.model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    assert sync(trainer, engine, 2) == (None, None)
    second = engine.wire_digest()
    assert second == trainer.serialized_digest()
    assert second != first
    dtypes = {dtype for dtype, _, _ in second.values()}
    expected_dtypes = {
        "bf16": {"bfloat16"},
        "fp8_blockwise": {"bfloat16", "float8_e4m3fn", "float32"},
        "mxfp8": {"bfloat16", "float8_e4m3fn", "uint8"},
        "int4_qat": {"bfloat16", "int32", "int64"},
    }[precision]
    assert dtypes == expected_dtypes


@pytest.fixture(scope="module")
def synced_mxfp8(base_overrides):
    trainer, engine = build_workers([*base_overrides, "precision=mxfp8"])
    assert sync(trainer, engine, 1) == (None, None)
    return trainer, engine


def _without(trainer, wire_name):
    def serialize(name, tensor):
        return {n: t for n, t in trainer.serialize(name, tensor).items() if n != wire_name}

    return serialize


def _renaming(trainer, old, new):
    def serialize(name, tensor):
        return {(new if n == old else n): t for n, t in trainer.serialize(name, tensor).items()}

    return serialize


EXPERT = "model.layers.1.mlp.experts.3.down_proj"
# case: (sync() arguments, version sent relative to the one the engine holds, expected message)
BAD = {
    "dropped tensor": (lambda tr: {"weights": [(n, t) for n, t in tr.trainer.hf_weights() if n != "model.norm.weight"]},
                       +1, r"`model\.norm\.weight` was dropped"),
    "unknown name": (lambda tr: {"serialize": _renaming(tr, "model.norm.weight", "model.norm.bias")},
                     +1, r"unknown tensor `model\.norm\.bias`"),
    "scale without its weight": (lambda tr: {"serialize": _without(tr, f"{EXPERT}.weight")},
                                 +1, rf"received \['{EXPERT}\.weight_scale'\] without \['{EXPERT}\.weight'\]"),
    "duplicate version": (lambda tr: {}, 0, "is a duplicate version"),
    "older version": (lambda tr: {}, -1, "is an older version"),
    "checksum mismatch": (lambda tr: {"corrupt_bucket": 0}, +1, "arrived corrupted"),
}  # fmt: skip


@pytest.mark.parametrize("case", BAD, ids=list(BAD))
def test_bad_sync_leaves_the_real_engine_unchanged(synced_mxfp8, case):
    trainer, engine = synced_mxfp8
    assert sync(trainer, engine, engine.engine.weight_version + 1) == (None, None)  # holds >= 2 now
    held_version = engine.engine.weight_version
    before = engine.wire_digest()
    make_kwargs, relative_version, message = BAD[case]
    with torch.no_grad():  # new weights, so an accepted sync would show
        for p in trainer.trainer.model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    send_err, recv_err = sync(trainer, engine, held_version + relative_version, **make_kwargs(trainer))
    for err in (send_err, recv_err):
        assert isinstance(err, SyncRefused) and re.search(message, str(err)), err
    assert engine.engine.weight_version == held_version
    assert engine.wire_digest() == before


def test_nan_in_trainer_weights_is_refused_naming_the_tensor(base_overrides):
    trainer, engine = build_workers([*base_overrides, "precision=fp8_blockwise"])
    assert sync(trainer, engine, 1) == (None, None)
    before = engine.wire_digest()
    with torch.no_grad():
        dict(trainer.trainer.model.named_parameters())["model.layers.0.mlp.experts.down_proj"][2, 5, 7] = (
            float("nan")
        )
    send_err, recv_err = sync(trainer, engine, 2, timeout_s=1.0)
    assert isinstance(send_err, SyncRefused)
    assert "model.layers.0.mlp.experts.2.down_proj.weight: 1 NaN" in str(send_err)
    assert isinstance(recv_err, SyncError)  # the engine waited for a manifest that never came
    assert engine.engine.weight_version == 1 and engine.wire_digest() == before


def test_trainer_scores_the_policy_the_engine_samples_at_its_temperature(base_overrides):
    """At rollout.temperature=0.5 the trainer's log-probs of the engine's samples match the engine's
    (bf16, identical weights); scored at temperature 1 instead, they would be a different policy."""
    from skyq.rl.batch import collate
    from skyq.rl.grpo import mismatch_metrics

    trainer, engine = build_workers([*base_overrides, "precision=bf16", "rollout.temperature=0.5"])
    assert trainer.trainer.temperature == 0.5
    assert sync(trainer, engine, 1) == (None, None)
    prompts = [[1, 4, 12, 5, 17], [1, 7, 12, 9, 17]]
    samples = engine.generate(prompts, n=8, max_new_tokens=3, temperature=0.5, top_p=1.0, seed=0)
    batch = collate(samples, [0.0] * len(samples), group_size=8, normalize_std=True, pad_token_id=0)
    train_logp = trainer.trainer.logprobs(batch.input_ids, batch.attention_mask)
    matched = mismatch_metrics(train_logp, batch.rollout_logprobs, batch.response_mask)
    trainer.trainer.temperature = 1.0
    other = mismatch_metrics(
        trainer.trainer.logprobs(batch.input_ids, batch.attention_mask),
        batch.rollout_logprobs,
        batch.response_mask,
    )
    assert matched["mismatch_mean_abs"] < 0.02, matched
    assert other["mismatch_mean_abs"] > 5 * matched["mismatch_mean_abs"], (matched, other)
