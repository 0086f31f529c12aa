"""The engine's fixed-capacity decoding (`skyq.rollout.decoding`), on CPU: the "static" mode runs
exactly what a CUDA graph replays (same cache, same padded rows), eagerly. Capture and replay are
tested on the GPU (tests/gpu/test_engine_graphs_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from skyq.rl.tasks import build_task
from skyq.rollout import decoding, embedded
from skyq.rollout.decoding import StaticDecoder, cache_capacity, padded_batch

SAMPLING = dict(temperature=1.0, top_p=1.0)


def test_padded_batch_sizes_are_powers_of_two_and_three_times_them():
    sizes = sorted({padded_batch(r) for r in range(1, 700)})
    assert sizes == [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768]
    for rows in range(1, 700):
        assert rows <= padded_batch(rows) <= max(2, rows * 3 // 2 + 1)
    with pytest.raises(ValueError, match="rows must be positive"):
        padded_batch(0)


def test_cache_capacity_rounds_up_to_the_step():
    assert [cache_capacity(p) for p in (1, 64, 65, 200)] == [64, 64, 128, 256]


@pytest.fixture
def engines(make_trainer, make_engine, serialize):
    """The same fp8 weights in a dynamic-cache engine and a static-cache one."""

    def make(precision: str = "fp8_blockwise"):
        wire = serialize(make_trainer(precision))
        dynamic, static = make_engine(precision), make_engine(precision)
        static.decode_mode = "static"
        for engine in (dynamic, static):
            engine.load_weights(wire, version=0)
        return dynamic, static

    return make


@pytest.mark.parametrize("precision", ["fp8_blockwise", "bf16"])
def test_static_cache_decodes_as_the_growing_cache_does(engines, run_cfg, precision):
    """Prompts of several lengths (so several decoders), rows padded to the decoder's batch: every
    real row samples the same tokens as with transformers' growing cache, with log-probs equal to
    bf16 rounding (the static cache attends over its whole capacity, masked)."""
    dynamic, static = engines(precision)
    prompts = [p.token_ids for p in build_task(run_cfg().task, seed=0).prompts(0, 10)]
    prompts.append(prompts[0][:3])  # a shorter length: its own group of 5 rows (padded to 6)
    a = dynamic.generate(prompts, n=5, max_new_tokens=4, seed=11, **SAMPLING)
    b = static.generate(prompts, n=5, max_new_tokens=4, seed=11, **SAMPLING)
    assert [s.response_ids for s in a] == [s.response_ids for s in b]
    assert [s.finish_reason for s in a] == [s.finish_reason for s in b]
    diff = max(
        abs(x - y) for sa, sb in zip(a, b, strict=True) for x, y in zip(sa.logprobs, sb.logprobs, strict=True)
    )
    assert diff < 2e-2, diff
    assert all(isinstance(d, StaticDecoder) for d in static._decoders.values())
    assert {d.batch for d in static._decoders.values()} >= {6}


def test_a_kept_decoder_is_reused_and_starts_empty(engines, run_cfg):
    """A second call with the same batch and capacity reuses the decoder (same cache tensors) and
    gives what a fresh engine gives: nothing of the previous call's cache leaks into it, with
    another prompt length in the same capacity included."""
    dynamic, static = engines()
    prompts = [p.token_ids for p in build_task(run_cfg().task, seed=0).prompts(0, 4)]
    first = static.generate(prompts[:1], n=4, max_new_tokens=3, seed=1, **SAMPLING)
    ((key, decoder),) = static._decoders.items()
    keys = decoder.cache.layers[0].keys
    shorter = [prompts[1][:-1]]
    assert cache_capacity(len(shorter[0]) + 3) == key[1]
    again = static.generate(shorter, n=4, max_new_tokens=3, seed=2, **SAMPLING)
    assert list(static._decoders) == [key] and static._decoders[key] is decoder
    assert decoder.cache.layers[0].keys is keys
    fresh = dynamic.generate(shorter, n=4, max_new_tokens=3, seed=2, **SAMPLING)
    assert [s.response_ids for s in again] == [s.response_ids for s in fresh]
    assert static.generate(prompts[:1], n=4, max_new_tokens=3, seed=1, **SAMPLING) == first


def test_decoders_kept_are_bounded_least_recently_used_first(engines, monkeypatch):
    _, static = engines()
    monkeypatch.setattr(embedded, "DECODERS_KEPT", 2)
    prompt = [1, 5, 13, 6, 18]
    for n in (1, 2, 3):  # three batch sizes: three decoders, the first dropped
        static.generate([prompt], n=n, max_new_tokens=2, seed=0, **SAMPLING)
    assert [key[0] for key in static._decoders] == [2, 3]
    static.generate([prompt], n=2, max_new_tokens=2, seed=0, **SAMPLING)  # reused: now the most recent
    assert [key[0] for key in static._decoders] == [3, 2]


def test_kept_decoders_caches_stay_within_the_memory_budget(engines, monkeypatch):
    """Beyond the count, the kept caches' bytes are bounded (on CUDA a fraction of the device): a
    new decoder drops the least recently used until it fits; the one in use always stays."""
    _, static = engines()
    prompt = [1, 5, 13, 6, 18]
    one_row = static._kv_bytes(1, 64)
    c = static.model.config
    assert one_row == 2 * c.num_hidden_layers * c.num_key_value_heads * 64 * c.head_dim * 2
    monkeypatch.setattr(type(static), "_cache_budget", lambda self: 5 * one_row)
    for n in (1, 2):  # 1 + 2 rows: fits
        static.generate([prompt], n=n, max_new_tokens=2, seed=0, **SAMPLING)
    assert [key[0] for key in static._decoders] == [1, 2]
    static.generate([prompt], n=3, max_new_tokens=2, seed=0, **SAMPLING)  # 3 more: 1 dropped, 2 + 3 fit
    assert [key[0] for key in static._decoders] == [2, 3]
    static.generate([prompt], n=6, max_new_tokens=2, seed=0, **SAMPLING)  # alone over the budget: kept
    assert [key[0] for key in static._decoders] == [6]


def test_a_static_decoder_refuses_another_batch(engines):
    _, static = engines()
    decoder = StaticDecoder(static.model, embedded._cache_kwarg(type(static.model)), 4, 64, graph=False)
    with pytest.raises(ValueError, match="StaticDecoder for 4 rows given 3"):
        decoder.forward(torch.ones((3, 2), dtype=torch.long))


def test_static_decoding_without_a_filled_cache_is_refused(engines, monkeypatch):
    """A model that ignores the cache argument leaves the static cache empty: refused at step 0."""
    _, static = engines()
    monkeypatch.setattr(embedded, "_cache_kwarg", lambda cls: "kv_cache_under_a_wrong_name")
    with pytest.raises(RuntimeError, match="the KV cache holds 0 positions after decode step 0"):
        static.generate([[1, 5, 13, 6, 18]], n=2, max_new_tokens=3, seed=0, **SAMPLING)


def test_graph_checks_name_the_first_flagged_tensor_after_a_replay():
    """The checks recorded during a capture are re-read after each replay: no flag, nothing; a set
    flag runs the validations in launch order, so the first bad tensor raises its own error."""
    checks = decoding._GraphChecks(torch.device("cpu"))
    seen: list[str] = []

    def validate(name: str, bad: bool):
        def run() -> None:
            seen.append(name)
            if bad:
                raise ValueError(f"{name} is not finite")

        return run

    flags = [torch.zeros(1, dtype=torch.int32) for _ in range(3)]
    checks.add(flags[0], validate("a", False), strict=False)
    checks.add(flags[1], validate("b", True), strict=True)
    checks.add(flags[2], validate("c", True), strict=True)
    checks.total = torch.stack([f for f, _, _ in checks.pending]).sum()  # what the graph recomputes
    checks.verify()
    assert seen == []
    checks.pending[1][0].fill_(1)
    checks.pending[2][0].fill_(1)
    checks.total = torch.stack([f for f, _, _ in checks.pending]).sum()
    with pytest.raises(ValueError, match="b is not finite"):
        checks.verify()
    assert seen == ["b"]
    assert len(checks.pending) == 3  # kept for the next replay


def test_graph_checks_hand_out_pooled_flags_and_verify_loosely_for_the_engine():
    """Launches in a graph-checks scope take their flags from its pool (views of one zeroed buffer,
    no zeroing kernel each), fresh tensors once it is full; `reset` zeroes the pool. A flag left set
    by an earlier replay whose tensor now validates passes `verify(strict=False)` (the engine then
    names the step) but is still a kernel bug to the strict check."""
    from skyq.quant.kernels import _common

    checks = decoding._GraphChecks(torch.device("cpu"))
    checks.flag_pool = _common.FlagPool(torch.device("cpu"), size=2)
    _common.push_deferred(checks)
    try:
        flags = [_common.new_flag(torch.device("cpu")) for _ in range(3)]
    finally:
        _common.pop_deferred()
    pool = checks.flag_pool.flags
    assert [f.data_ptr() for f in flags[:2]] == [pool[0:1].data_ptr(), pool[1:2].data_ptr()]
    assert flags[2].data_ptr() not in (pool[0:1].data_ptr(), pool[1:2].data_ptr())
    assert _common.new_flag(torch.device("cpu")).data_ptr() != pool.data_ptr()  # no scope: fresh
    flags[0].fill_(1)
    checks.add(flags[0], lambda: None, strict=True)  # the tensor validates: the flag is stale
    checks.total = flags[0].sum()
    checks.verify(strict=False)
    with pytest.raises(AssertionError, match="reference validation accepted"):
        checks.verify()
    checks.reset()
    assert int(pool.sum()) == 0 and int(checks.seen) == 0


@pytest.mark.parametrize("mode", ["dynamic", "static"])
def test_non_finite_logits_fail_the_call_naming_the_step(engines, run_cfg, mode):
    """An lm_head that overflows (inf written past `load_weights`' checks) gives non-finite logits: the
    call raises naming the decode step instead of sampling from them."""
    dynamic, static = engines("bf16")
    engine = dynamic if mode == "dynamic" else static
    prompts = [p.token_ids for p in build_task(run_cfg().task, seed=0).prompts(0, 2)]
    with torch.no_grad():
        engine.model.lm_head.weight[3] = float("inf")
    with pytest.raises(RuntimeError, match="non-finite logits at decode step 0"):
        engine.generate(prompts, n=2, max_new_tokens=3, seed=0, **SAMPLING)


def test_static_decode_attends_over_the_grouped_cache_without_expanding_it(engines, run_cfg, monkeypatch):
    """The fixed-capacity cache always comes with a mask; each one-token step's attention runs on the
    key/value heads as cached, a group's query heads as its rows (`skyq.ops.attention`), never on a
    cache expanded to every query head (transformers' `repeat_kv`)."""
    _, static = engines("bf16")
    config = static.model.config
    groups = config.num_attention_heads // config.num_key_value_heads
    assert groups > 1 and config._attn_implementation == "skyq_sdpa"
    shapes = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(
        torch.nn.functional, "scaled_dot_product_attention",
        lambda q, k, v, *a, **kw: shapes.append((tuple(q.shape), tuple(k.shape))) or sdpa(q, k, v, *a, **kw),
    )  # fmt: skip
    prompts = [p.token_ids for p in build_task(run_cfg().task, seed=0).prompts(0, 2)]
    static.generate(prompts[:1], n=3, max_new_tokens=4, seed=5, **SAMPLING)
    prompt_len = len(prompts[0])
    steps = [(q, k) for q, k in shapes if q[2] != prompt_len]  # the one-token steps (rows stop at eos)
    assert steps and len(steps) % config.num_hidden_layers == 0
    assert all(q[1:3] == (config.num_key_value_heads, groups) for q, k in steps)  # a group's heads as rows
    assert all(k[1] == config.num_key_value_heads for _, k in shapes)  # no expanded cache anywhere


@pytest.mark.parametrize("mode", ["dynamic", "static"])
def test_one_token_steps_run_as_decode_steps_and_prefill_and_scoring_do_not(engines, run_cfg, mode):
    """Every one-token forward of the decode loop runs inside `quantized_linear.decode_step` (the
    decode paths at any batch); the prompt's prefill and `score` (teacher-forced, the trainer's bits)
    run outside it."""
    from skyq.rollout.quantized_linear import WireExperts, in_decode_step

    dynamic, static = engines("fp8_blockwise")
    engine = dynamic if mode == "dynamic" else static
    seen = []
    experts = next(m for m in engine.model.modules() if isinstance(m, WireExperts))
    handle = experts.register_forward_pre_hook(
        lambda _m, args: seen.append((args[0].shape[0], in_decode_step()))
    )
    try:
        prompts = [p.token_ids for p in build_task(run_cfg().task, seed=0).prompts(0, 1)]
        engine.generate(prompts, n=3, max_new_tokens=4, seed=5, **SAMPLING)
        prefill, *steps = seen
        assert prefill == (3 * len(prompts[0]), False)
        assert steps and all(step for _, step in steps) and {rows for rows, _ in steps} == {3}
        seen.clear()
        ids = torch.tensor([prompts[0]])
        engine.score(ids, torch.ones_like(ids))
        assert seen == [(len(prompts[0]), False)]
    finally:
        handle.remove()
