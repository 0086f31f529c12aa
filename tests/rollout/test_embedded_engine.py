"""EmbeddedEngine: wire-format weights, validated loads, sampling, agreement with the trainer."""

from __future__ import annotations

import pytest
import torch
from native_fixtures import PRECISIONS

from skyq.rl.batch import FinishReason, collate
from skyq.rl.grpo import mismatch_metrics
from skyq.rl.tasks import build_task
from skyq.rollout.embedded import WeightLoadError


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8) if t.is_floating_point() else t


@pytest.mark.parametrize("precision", PRECISIONS)
def test_engine_holds_exactly_the_serialized_wire_tensors(make_trainer, make_engine, serialize, precision):
    trainer, engine = make_trainer(precision), make_engine(precision)
    wire = serialize(trainer)
    engine.load_weights(wire, version=0)
    held = engine.wire_state()
    assert set(held) == set(wire) and engine.weight_version == 0
    for name, tensor in wire.items():
        assert held[name].dtype == tensor.dtype and torch.equal(_bits(held[name]), _bits(tensor)), name
    quantized = [p for p in engine.plan if p.quantized]
    assert bool(quantized) == (precision != "bf16")
    for p in quantized:  # held as wire units, never as a dequantized bf16 copy
        assert p.name not in held or held[p.name].dtype == torch.float8_e4m3fn, p.name


def _corrupt(wire: dict[str, torch.Tensor], how: str) -> tuple[dict[str, torch.Tensor], str]:
    wire = dict(wire)
    if how == "missing":
        del wire["model.layers.1.mlp.experts.2.down_proj.weight_scale_inv"]
        return wire, "model.layers.1.mlp.experts.2.down_proj.weight_scale_inv: missing"
    if how == "unknown":
        wire["model.layers.7.mlp.experts.0.up_proj.weight"] = torch.zeros(64, 64, dtype=torch.bfloat16)
        return wire, "model.layers.7.mlp.experts.0.up_proj.weight: not in the"
    if how == "shape":
        wire["model.layers.0.self_attn.k_proj.weight"] = wire["model.layers.0.self_attn.q_proj.weight"]
        return wire, "model.layers.0.self_attn.k_proj.weight: expected shape"
    if how == "dtype":
        wire["model.norm.weight"] = wire["model.norm.weight"].float()
        return wire, "model.norm.weight: expected shape"
    scale = wire["model.layers.0.self_attn.o_proj.weight_scale_inv"].clone()
    scale[0, 0] = float("nan")
    wire["model.layers.0.self_attn.o_proj.weight_scale_inv"] = scale
    return wire, "model.layers.0.self_attn.o_proj.weight"


@pytest.mark.parametrize("how", ["missing", "unknown", "shape", "dtype", "nan_scale"])
def test_bad_updates_are_refused_and_change_nothing(make_trainer, make_engine, serialize, how):
    trainer, engine = make_trainer(), make_engine()
    good = serialize(trainer)
    engine.load_weights(good, version=3)
    before = engine.wire_state()
    with torch.no_grad():  # new weights: the refused update must not leak any of them
        for p in trainer.model.parameters():
            p.mul_(1.5)
    bad, message = _corrupt(serialize(trainer), how)
    with pytest.raises(WeightLoadError, match=message.replace(".", r"\.").replace("[", r"\[")):
        engine.load_weights(bad, version=4)
    assert engine.weight_version == 3
    after = engine.wire_state()
    assert all(torch.equal(_bits(after[n]), _bits(before[n])) for n in before)


def test_versions_must_increase(make_trainer, make_engine, serialize):
    engine, wire = make_engine(), serialize(make_trainer())
    engine.load_weights(wire, version=5)
    for stale in (5, 4):
        with pytest.raises(WeightLoadError, match="strictly increasing"):
            engine.load_weights(wire, version=stale)
    assert engine.weight_version == 5


def test_generate_before_any_weights_is_refused(make_engine):
    with pytest.raises(WeightLoadError, match="before load_weights"):
        make_engine().generate([[1, 4, 18]], n=1, max_new_tokens=2, temperature=1.0, top_p=1.0, seed=0)


def test_generate_groups_samples_and_is_reproducible(make_trainer, make_engine, serialize):
    engine = make_engine()
    engine.load_weights(serialize(make_trainer()), version=0)
    prompts = [[1, 5, 13, 6, 18], [1, 4, 18], [1, 9, 13, 9, 18]]  # mixed lengths
    kwargs = dict(n=4, max_new_tokens=3, temperature=1.0, top_p=1.0)
    samples = engine.generate(prompts, seed=7, **kwargs)
    assert len(samples) == 12
    for i, sample in enumerate(samples):
        assert sample.prompt_ids == prompts[i // 4]
        assert len(sample.logprobs) == len(sample.response_ids) <= 3
        assert all(lp <= 0 for lp in sample.logprobs)
        stopped = sample.response_ids[-1] == engine.eos_token_id
        assert sample.finish_reason == (FinishReason.stop if stopped else FinishReason.length)
        assert engine.eos_token_id not in sample.response_ids[:-1]
    assert engine.generate(prompts, seed=7, **kwargs) == samples
    assert engine.generate(prompts, seed=8, **kwargs) != samples


@pytest.mark.parametrize("precision", PRECISIONS)
def test_engine_logprobs_agree_with_the_trainer(make_trainer, make_engine, serialize, run_cfg, precision):
    trainer, engine = make_trainer(precision), make_engine(precision)
    engine.load_weights(serialize(trainer), version=0)
    task = build_task(run_cfg().task, seed=0)
    prompts = task.prompts(0, 16)
    samples = engine.generate(
        [p.token_ids for p in prompts], n=4, max_new_tokens=4, temperature=1.0, top_p=1.0, seed=0
    )
    batch = collate(samples, [0.0] * len(samples), group_size=4, normalize_std=False, pad_token_id=0)
    metrics = mismatch_metrics(trainer.logprobs(batch.input_ids, batch.attention_mask), batch.rollout_logprobs,
                               batch.response_mask)  # fmt: skip
    print(f"{precision}: engine (bf16 compute) vs trainer (fp32 compute) {metrics}")
    # Same weights bit for bit; what differs is bf16 vs fp32 arithmetic (and, for the FP8 recipes,
    # activation codes that round differently from bf16 vs fp32 inputs).
    assert metrics["mismatch_mean_abs"] < 0.03
    assert metrics["mismatch_max"] < 0.3


def test_trainer_scores_at_the_sampling_temperature(run_cfg, tiny_checkpoint, make_engine, serialize):
    from skyq.trainer.native.trainer import NativeTrainer

    cfg = run_cfg("bf16")
    kwargs = dict(model_cfg=cfg.model, precision_cfg=cfg.precision, optimizer_cfg=cfg.trainer.optimizer,
                  algorithm_cfg=cfg.algorithm, micro_batch_size=64, checkpoint_path=tiny_checkpoint, seed=0)  # fmt: skip
    at_temperature, at_one = NativeTrainer(**kwargs, temperature=0.6), NativeTrainer(**kwargs)
    engine = make_engine("bf16")
    engine.load_weights(serialize(at_one), version=0)
    samples = engine.generate(
        [[1, 5, 13, 6, 18]] * 8, n=4, max_new_tokens=4, temperature=0.6, top_p=1.0, seed=0
    )
    batch = collate(samples, [0.0] * len(samples), group_size=4, normalize_std=False, pad_token_id=0)
    scored = {
        name: mismatch_metrics(
            t.logprobs(batch.input_ids, batch.attention_mask), batch.rollout_logprobs, batch.response_mask
        )["mismatch_mean_abs"]  # fmt: skip
        for name, t in (("matched", at_temperature), ("unmatched", at_one))
    }
    assert scored["matched"] < 0.02 < scored["unmatched"]


def _corrupt_one_expert(wire: dict[str, torch.Tensor], precision: str) -> dict[str, torch.Tensor]:
    """A bad value in expert 2 of a stack the engine checks in one call (the others stay good)."""
    wire, stem = dict(wire), "model.layers.1.mlp.experts.2.down_proj."
    if precision == "bf16":
        bad = wire[stem + "weight"].clone()
        bad[3, 5] = float("inf")
        wire[stem + "weight"] = bad
    elif precision == "int4_qat":
        wire[stem + "weight_shape"] = wire[stem + "weight_shape"] + 1
    elif precision == "mxfp8":
        scale = wire[stem + "weight_scale"].clone()
        scale[0, 0] = 0xFF  # the E8M0 NaN byte
        wire[stem + "weight_scale"] = scale
    else:
        codes = wire[stem + "weight"].clone()
        codes.view(torch.uint8)[4, 4] = 0x7F  # an e4m3 NaN code
        wire[stem + "weight"] = codes
    return wire


@pytest.mark.parametrize("precision", PRECISIONS)
def test_a_bad_value_inside_an_expert_stack_is_refused_naming_that_expert(
    make_trainer, make_engine, serialize, precision
):
    trainer, engine = make_trainer(precision), make_engine(precision)
    good = serialize(trainer)
    engine.load_weights(good, version=1)
    before = engine.wire_state()
    with pytest.raises(WeightLoadError, match=r"model\.layers\.1\.mlp\.experts\.2\.down_proj\.weight"):
        engine.load_weights(_corrupt_one_expert(good, precision), version=2)
    assert engine.weight_version == 1
    after = engine.wire_state()
    assert all(torch.equal(_bits(after[n]), _bits(before[n])) for n in before)


def test_cache_argument_name_follows_the_transformers_signature():
    """transformers renamed the forward's `past_key_values` to `cache`; an unknown keyword would be
    swallowed by **kwargs, so the engine looks the name up instead of guessing."""
    from skyq.rollout.embedded import _cache_kwarg

    class New:
        def forward(self, input_ids=None, cache=None, **kwargs): ...

    class Old:
        def forward(self, input_ids=None, past_key_values=None, **kwargs): ...

    class Neither:
        def forward(self, input_ids=None, **kwargs): ...

    assert _cache_kwarg(New) == "cache"
    assert _cache_kwarg(Old) == "past_key_values"
    with pytest.raises(RuntimeError, match="neither `cache` nor `past_key_values`"):
        _cache_kwarg(Neither)


def test_decoding_without_a_filled_kv_cache_is_refused(make_trainer, make_engine, serialize, monkeypatch):
    """If the model ignored the cache, every token after the first would be sampled without its
    context; the engine checks the cache length each step and stops loudly instead."""
    from skyq.rollout import embedded

    engine = make_engine()
    engine.load_weights(serialize(make_trainer()), version=0)
    monkeypatch.setattr(embedded, "_cache_kwarg", lambda cls: "kv_cache_under_a_wrong_name")
    with pytest.raises(RuntimeError, match="the KV cache holds 0 positions after decode step 0"):
        engine.generate([[1, 5, 13, 6, 18]], n=2, max_new_tokens=3, temperature=1.0, top_p=1.0, seed=0)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_teacher_forced_scores_equal_the_sampled_logprobs(
    make_trainer, make_engine, serialize, run_cfg, precision
):
    """`score` recomputes in one forward the log-probs `generate` reported token by token with its
    KV cache: the same weights and arithmetic, so they agree to bf16 rounding of the attention path."""
    trainer, engine = make_trainer(precision), make_engine(precision)
    engine.load_weights(serialize(trainer), version=0)
    prompts = build_task(run_cfg().task, seed=0).prompts(0, 8)
    samples = engine.generate([p.token_ids for p in prompts], n=2, max_new_tokens=4, temperature=1.0, top_p=1.0,
                              seed=3)  # fmt: skip
    batch = collate(samples, [0.0] * len(samples), group_size=2, normalize_std=False, pad_token_id=0)
    scored = engine.score(batch.input_ids, batch.attention_mask)
    mask = batch.response_mask.bool()
    diff = (scored[mask] - batch.rollout_logprobs[mask]).abs()
    assert float(diff.max()) < 0.05, float(diff.max())
