"""The embedded engine serving the tiny DeepSeek-V3 (model=tiny_deepseek, Kimi-K2.6's text
architecture): the accounted weight sync from the native trainer, log-probs against the trainer's,
the MLA cache, and the seed's two-checkpoint layout for int4_qat (the engine boots from the W4A16
release, the trainer from its BF16 cast)."""

from __future__ import annotations

import pytest
import torch
from deepseek_fixtures import serialize_all
from native_fixtures import sync_in_process

from skyq.launch.actors import EngineWorker, TrainerWorker
from skyq.rl.batch import collate
from skyq.rl.grpo import mismatch_metrics
from skyq.rl.tasks import build_task
from skyq.rl.tokenizer import EOS_ID
from skyq.rollout.embedded import WeightLoadError
from skyq.sync.errors import SyncRefused
from skyq.tools import convert_hf_to_int4, convert_moe_int4_to_bf16

PRECISIONS = ["bf16", "fp8_blockwise", "mxfp8", "int4_qat"]
WIRE_DTYPES = {
    "bf16": {"bfloat16"},
    "fp8_blockwise": {"bfloat16", "float8_e4m3fn"},  # + fp32 block scales (and the router bias)
    "mxfp8": {"bfloat16", "float8_e4m3fn", "uint8"},
    "int4_qat": {"bfloat16", "int32", "int64"},
}
"""The wire's dtypes per precision besides fp32 (the router bias, always fp32)."""
BIAS = "language_model.model.layers.1.mlp.gate.e_score_correction_bias"


def _workers(cfg, checkpoint: str) -> tuple[TrainerWorker, EngineWorker]:
    trainer = TrainerWorker(
        model_cfg=cfg.model, precision_cfg=cfg.precision, optimizer_cfg=cfg.trainer.optimizer,
        algorithm_cfg=cfg.algorithm, micro_batch_size=64, checkpoint_path=checkpoint, device="cpu", seed=0,
        temperature=1.0,
    )  # fmt: skip
    engine = EngineWorker(
        model_cfg=cfg.model, precision_cfg=cfg.precision, device="cpu", seed=0, eos_token_id=EOS_ID
    )
    return trainer, engine


@pytest.mark.parametrize("precision", PRECISIONS)
def test_the_sync_lands_bit_for_bit_with_the_router_bias_in_fp32(
    deepseek_cfg, deepseek_checkpoint, precision
):
    trainer, engine = _workers(deepseek_cfg(precision), deepseek_checkpoint)
    assert sync_in_process(trainer, engine, 1) == (None, None)
    first = engine.wire_digest()
    assert first == trainer.serialized_digest() and engine.engine.weight_version == 1
    assert first[BIAS][0] == "float32"
    assert {dtype for dtype, _, _ in first.values()} == WIRE_DTYPES[precision] | {"float32"}
    with torch.no_grad():  # new weights: the next sync must carry them
        for p in trainer.trainer.model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    assert sync_in_process(trainer, engine, 2) == (None, None)
    assert engine.wire_digest() == trainer.serialized_digest() != first
    # a sync without the router bias is refused by the accounting; the engine keeps version 2
    held = engine.wire_digest()
    dropped = [(n, t) for n, t in trainer.trainer.hf_weights() if n != BIAS]
    send_err, recv_err = sync_in_process(trainer, engine, 3, weights=dropped)
    for err in (send_err, recv_err):
        assert isinstance(err, SyncRefused) and f"`{BIAS}` was dropped" in str(err), err
    assert engine.engine.weight_version == 2 and engine.wire_digest() == held


@pytest.mark.parametrize("precision", PRECISIONS)
def test_engine_logprobs_agree_with_the_trainer(
    make_deepseek_trainer, make_deepseek_engine, deepseek_cfg, precision
):
    """The qwen3_moe bounds (tests/rollout/test_embedded_engine.py): the same weights bit for bit, bf16
    engine arithmetic against the trainer's fp32; and `score` equals what `generate` reported."""
    trainer, engine = make_deepseek_trainer(precision), make_deepseek_engine(precision)
    engine.load_weights(serialize_all(trainer), version=0)
    prompts = build_task(deepseek_cfg().task, seed=0).prompts(0, 16)
    samples = engine.generate(
        [p.token_ids for p in prompts], n=4, max_new_tokens=4, temperature=1.0, top_p=1.0, seed=0
    )
    batch = collate(samples, [0.0] * len(samples), group_size=4, normalize_std=False, pad_token_id=0)
    metrics = mismatch_metrics(
        trainer.logprobs(batch.input_ids, batch.attention_mask), batch.rollout_logprobs, batch.response_mask
    )
    assert metrics["mismatch_mean_abs"] < 0.03 and metrics["mismatch_max"] < 0.3, metrics
    mask = batch.response_mask.bool()
    scored = engine.score(batch.input_ids, batch.attention_mask)
    assert float((scored[mask] - batch.rollout_logprobs[mask]).abs().max()) < 0.05


def test_the_kv_cache_holds_mla_latents_and_a_fixed_capacity_cache_decodes_the_same(
    make_deepseek_trainer, make_deepseek_engine
):
    """Per layer and position the cache holds the compressed latent (kv_lora_rank) and the shared
    rotated key (qk_rope_head_dim), one head: MLA's cache, not per-head keys and values. The
    fixed-capacity cache (what a CUDA graph replays) samples the same tokens as the growing one."""
    engine = make_deepseek_engine("bf16")
    engine.load_weights(serialize_all(make_deepseek_trainer("bf16")), version=0)
    cfg = engine.model_cfg
    decoder = engine._decoder(2, 16)
    decoder.forward(torch.tensor([[1, 5, 13, 6, 18]] * 2))
    layer = decoder.cache.layers[0]
    assert tuple(layer.keys.shape) == (2, 1, 5, cfg.kv_lora_rank)
    assert tuple(layer.values.shape) == (2, 1, 5, cfg.qk_rope_head_dim)
    assert engine._kv_bytes(2, 16) == cfg.num_layers * 2 * 16 * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 2
    prompts = [[1, 5, 13, 6, 18], [1, 4, 18]]
    kwargs = dict(n=3, max_new_tokens=5, temperature=1.0, top_p=1.0, seed=4)
    dynamic = engine.generate(prompts, **kwargs)
    engine.decode_mode = "static"
    static = engine.generate(prompts, **kwargs)
    assert [s.response_ids for s in static] == [s.response_ids for s in dynamic]
    diff = max(abs(a - b) for s, d in zip(static, dynamic) for a, b in zip(s.logprobs, d.logprobs))
    assert diff < 0.02, diff


@pytest.fixture(scope="module")
def release_and_cast(deepseek_checkpoint, tmp_path_factory):
    """The seed's layout at tiny scale: a W4A16 release (g32, kimi grid) converted from the tiny BF16
    checkpoint, and its BF16 cast, both written by skyq's converters."""
    root = tmp_path_factory.mktemp("tiny_kimi")
    release, cast = root / "release", root / "bf16"
    args = [
        "--model-dir",
        deepseek_checkpoint,
        "--save-dir",
        str(release),
        "--group-size",
        "32",
        "--grid",
        "kimi",
    ]
    assert convert_hf_to_int4.main(args) == 0
    assert convert_moe_int4_to_bf16.main(["--model-dir", str(release), "--output-dir", str(cast)]) == 0
    return str(release), str(cast)


def test_the_engine_boots_from_the_w4a16_release_and_the_trainer_from_its_bf16_cast(
    make_deepseek_trainer, make_deepseek_engine, release_and_cast
):
    """The engine booted from the release holds bit for bit what the trainer (loaded from the BF16
    cast) sends in its first int4_qat sync, so the run starts on one policy; both checkpoints are
    refused in the other's role, naming what is wrong."""
    release, cast = release_and_cast
    trainer = make_deepseek_trainer("int4_qat", checkpoint=cast)
    booted, synced = make_deepseek_engine("int4_qat"), make_deepseek_engine("int4_qat")
    booted.load_checkpoint(release)
    synced.load_weights(serialize_all(trainer), version=0)
    held, sent = booted.wire_state(), synced.wire_state()
    assert set(held) == set(sent) and booted.weight_version == 0
    for name, tensor in sent.items():
        assert held[name].dtype == tensor.dtype and torch.equal(held[name], tensor), name
    prompts = [[1, 5, 13, 6, 18], [1, 4, 18]]
    kwargs = dict(n=2, max_new_tokens=4, temperature=1.0, top_p=1.0, seed=1)
    assert booted.generate(prompts, **kwargs) == synced.generate(prompts, **kwargs)
    with pytest.raises(WeightLoadError, match=r"experts\.0\.gate_proj\.weight_packed: missing"):
        make_deepseek_engine("int4_qat").load_checkpoint(cast)
    with pytest.raises(WeightLoadError, match=r"experts\.0\.gate_proj\.weight: missing"):
        make_deepseek_engine("bf16").load_checkpoint(release)
