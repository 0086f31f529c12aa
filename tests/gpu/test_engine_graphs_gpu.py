"""The engine's decode step captured in a CUDA graph and replayed (`skyq.rollout.decoding`), on the GPU:
the replayed steps give what the same steps give eagerly, bit for bit; weight updates reach the
graph; a non-finite activation during a replay raises the eager engine's error. Needs the config
stack (hydra) for the run config."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("hydra")

from native_fixtures import _one_thread, make_trainer, run_cfg, tiny_checkpoint  # noqa: E402, F401

from skyq.quant.errors import QuantizationError  # noqa: E402
from skyq.quant.kernels import dispatch  # noqa: E402
from skyq.rl.tasks import build_task  # noqa: E402
from skyq.rollout.kernels import fp8_linear, int4_mxfp8_linear

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

SAMPLING = dict(temperature=1.0, top_p=1.0)


def _wire(trainer):
    wire = {}
    for name, tensor in trainer.hf_weights():
        wire.update(
            trainer.strategy.serialize(name, tensor, role=trainer.layout.role(name, trainer.model_cfg))
        )
    return wire


def _engines(request, precision):
    """(graph engine, static engine): the same weights, the graph one replaying its steps."""
    from skyq.rollout.embedded import EmbeddedEngine

    cfg = request.getfixturevalue("run_cfg")(precision)
    trainer = request.getfixturevalue("make_trainer")(precision)
    engines = []
    for mode in ("graph", "static"):
        engine = EmbeddedEngine(model_cfg=cfg.model, precision_cfg=cfg.precision, seed=0, device="cuda")
        assert engine.decode_mode == "graph"
        engine.decode_mode = mode
        engine.load_weights(_wire(trainer), version=0)
        engines.append(engine)
    return (*engines, trainer, cfg)


@pytest.mark.parametrize("precision", ["fp8_blockwise", "bf16"])
def test_replayed_steps_equal_the_eager_steps_bit_for_bit(request, precision):
    """Several prompt lengths and batch sizes (padded rows included): the graph engine samples the
    same tokens with the same log-probs, bit for bit, as the same fixed-capacity steps run eagerly,
    and it did replay (one capture per decoder, every later step a replay)."""
    graph, static, _, cfg = _engines(request, precision)
    prompts = [p.token_ids for p in build_task(cfg.task, seed=0).prompts(0, 12)]
    prompts.append(prompts[0][:3])
    for seed, n in ((0, 4), (1, 5), (2, 4)):
        a = graph.generate(prompts, n=n, max_new_tokens=6, seed=seed, **SAMPLING)
        b = static.generate(prompts, n=n, max_new_tokens=6, seed=seed, **SAMPLING)
        assert a == b
    assert sum(d.replays for d in graph._decoders.values()) > 0
    assert all(d._graph is not None for d in graph._decoders.values())


def test_a_weight_update_reaches_the_captured_graph(request):
    """Weights are copied into the tensors the graph reads: after an update the replayed steps
    sample from the new weights (equal to an eager engine given the same update)."""
    graph, static, trainer, cfg = _engines(request, "fp8_blockwise")
    prompts = [p.token_ids for p in build_task(cfg.task, seed=0).prompts(0, 8)]
    before = graph.generate(prompts, n=4, max_new_tokens=5, seed=0, **SAMPLING)
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.mul_(-1.5)
    for engine in (graph, static):
        engine.load_weights(_wire(trainer), version=1)
    after = graph.generate(prompts, n=4, max_new_tokens=5, seed=0, **SAMPLING)
    assert after == static.generate(prompts, n=4, max_new_tokens=5, seed=0, **SAMPLING)
    assert after != before


def test_a_non_finite_activation_in_a_replay_raises_the_eager_error(request):
    """A NaN that first appears in a replayed step (an embedding row only the decode input uses,
    written after the capture) fails the replay with the `QuantizationError` the eager step raises,
    naming the same tensor."""
    graph, static, _, cfg = _engines(request, "fp8_blockwise")
    prompt = torch.tensor([[1, 5, 13, 6, 18]] * 4, device="cuda")
    errors = []
    for engine in (graph, static):
        with torch.inference_mode():
            decoder = engine._decoder(4, 16)
            decoder.forward(prompt)  # prefill
            decoder.forward(prompt[:, -1:])  # graph: the eager warm-up, then the capture
            engine.model.get_input_embeddings().weight[7] = float("nan")
            bad = torch.full((4, 1), 7, device="cuda")
            with pytest.raises(QuantizationError) as err, dispatch.deferred_finite_checks():
                decoder.forward(bad)
        errors.append(str(err.value))
    assert graph._decoders[(4, 64)].replays == 1
    assert errors[0] == errors[1]


@pytest.mark.parametrize("precision", ["fp8_blockwise", "bf16"])
def test_batches_past_the_decode_rows_are_captured_too(request, monkeypatch, precision):
    """A step of more than DECODE_MAX_ROWS rows has no host sync either: captured, replayed, and equal
    to the static engine bit for bit. Its experts take the decode paths (`quantized_linear.decode_step`):
    FP8 on codes both sides (96 rows x top-2 over 4 experts: at least `W8A8_MIN_MEAN_ROWS` an expert),
    dense FP8 linears too, no stack dequantized in a step; bf16 on the stacks as they are, no copy."""
    from skyq.rollout import quantized_linear as ql

    graph, static, _, cfg = _engines(request, precision)
    graph.eos_token_id = static.eos_token_id = -1  # every row decodes every step: replays happen
    stacks = [
        q for m in graph.model.modules() if isinstance(m, ql.WireExperts) for q, _ in m.stacked.values()
    ]
    kernel, dequantized, bf16, dense = [], [], [], []
    real_kernel, real_dequant, real_bf16, real_dense = (
        fp8_linear.fp8_grouped_w8a8_linear, dispatch.dequantize_fp8_blockwise, ql.bf16_grouped_linear,
        fp8_linear.fp8_w8a8_linear,
    )  # fmt: skip
    monkeypatch.setattr(fp8_linear, "fp8_grouped_w8a8_linear",
                        lambda *a, **k: kernel.append(ql.in_decode_step()) or real_kernel(*a, **k))  # fmt: skip
    monkeypatch.setattr(fp8_linear, "fp8_w8a8_linear",
                        lambda *a, **k: dense.append(ql.in_decode_step()) or real_dense(*a, **k))  # fmt: skip
    monkeypatch.setattr(dispatch, "dequantize_fp8_blockwise",
                        lambda *a, **k: dequantized.append((ql.in_decode_step(), k.get("name")))
                        or real_dequant(*a, **k))  # fmt: skip
    monkeypatch.setattr(ql, "bf16_grouped_linear",
                        lambda x, w, o: bf16.append((ql.in_decode_step(), any(w is q for q in stacks)))
                        or real_bf16(x, w, o))  # fmt: skip
    prompts = [p.token_ids for p in build_task(cfg.task, seed=0).prompts(0, 1)]
    a = graph.generate(prompts, n=80, max_new_tokens=4, seed=0, **SAMPLING)
    ((key, decoder),) = graph._decoders.items()
    assert key[0] == 96 and decoder._graph is not None and decoder.replays > 0
    assert not any(step for step, _ in dequantized)
    if precision == "fp8_blockwise":
        assert 96 * 2 >= ql.W8A8_MIN_MEAN_ROWS * 4
        assert kernel and all(kernel) and dense and all(dense)  # the warm-up step and the capture
    else:
        assert any(step for step, _ in bf16) and all(stack for step, stack in bf16 if step)
    assert a == static.generate(prompts, n=80, max_new_tokens=4, seed=0, **SAMPLING)


def test_mxfp8_steps_are_captured_on_the_mxfp8_kernels(request, monkeypatch):
    """MXFP8 experts in decode steps run the grouped MXFP8 weight-only kernel on their rows'
    activation-quantized values (no weight dequantized in a step): the step is captured, replayed,
    and samples as the static engine does, bit for bit."""
    from skyq.rollout import quantized_linear as ql

    graph, static, _, cfg = _engines(request, "mxfp8")
    graph.eos_token_id = static.eos_token_id = -1  # every row decodes every step: replays happen
    grouped, dequantized = [], []
    real_grouped, real_deq = int4_mxfp8_linear.mxfp8_grouped_weight_only_linear, dispatch.dequantize_mxfp8
    monkeypatch.setattr(int4_mxfp8_linear, "mxfp8_grouped_weight_only_linear",
                        lambda *a: grouped.append(ql.in_decode_step()) or real_grouped(*a))  # fmt: skip
    monkeypatch.setattr(dispatch, "dequantize_mxfp8",
                        lambda *a, **k: dequantized.append(ql.in_decode_step()) or real_deq(*a, **k))  # fmt: skip
    prompts = [p.token_ids for p in build_task(cfg.task, seed=0).prompts(0, 4)]
    a = graph.generate(prompts, n=2, max_new_tokens=4, seed=0, **SAMPLING)
    assert all(d._graph is not None and d.replays > 0 for d in graph._decoders.values())
    assert grouped and all(grouped)
    assert dequantized and not any(dequantized)  # prefill only
    assert a == static.generate(prompts, n=2, max_new_tokens=4, seed=0, **SAMPLING)


def test_mxfp8_decode_kernels_give_the_dequantized_weights_logits(request, monkeypatch):
    """One MXFP8 decode step on the kernels against the same step with the kernels refused (each
    weight dequantized, the experts' loop): the logits agree within the bf16 rounding of a different
    fp32 summation order."""
    _, static, _, _ = _engines(request, "mxfp8")
    _assert_kernel_logits_near_the_refused_ones(static, monkeypatch, "mxfp8_kernel_takes")


def _assert_kernel_logits_near_the_refused_ones(static, monkeypatch, takes: str) -> None:
    """One decode step's logits with the weight-only kernels, then with `dispatch.<takes>` refusing
    them (each weight dequantized, the experts' loop): equal within 5% of the largest logit."""
    prompt = torch.tensor([[1, 5, 13, 6, 18]] * 4, device="cuda")
    logits = []
    for kernels in (True, False):
        if not kernels:
            monkeypatch.setattr(dispatch, takes, lambda *a: False)
        with torch.inference_mode():
            decoder = static._decoder(4, 16)
            decoder.forward(prompt)
            logits.append(decoder.forward(prompt[:, -1:]).float())
        static._decoders.clear()
    assert float((logits[0] - logits[1]).abs().max()) < 5e-2 * float(logits[1].abs().max())


def _int4_engines(request, scope: str):
    """(graph engine, static engine, run config) of INT4 weights over `scope` (`precision.qat_scope`:
    routed_experts, the default, or all_linear, the attention projections too)."""
    import dataclasses

    from skyq.config.enums import QuantScope
    from skyq.quant.strategies import get_strategy
    from skyq.rollout.embedded import EmbeddedEngine

    cfg = request.getfixturevalue("run_cfg")("int4_qat")
    trainer = request.getfixturevalue("make_trainer")("int4_qat")
    precision = dataclasses.replace(cfg.precision, qat_scope=QuantScope(scope))
    strategy = get_strategy(precision)
    wire = {}
    for name, tensor in trainer.hf_weights():
        wire.update(strategy.serialize(name, tensor, role=trainer.layout.role(name, trainer.model_cfg)))
    engines = []
    for mode in ("graph", "static"):
        engine = EmbeddedEngine(model_cfg=cfg.model, precision_cfg=precision, seed=0, device="cuda")
        engine.decode_mode = mode
        engine.load_weights(wire, version=0)
        engines.append(engine)
    return (*engines, cfg)


@pytest.mark.parametrize("scope", ["routed_experts", "all_linear"])
@pytest.mark.parametrize("n", [2, 80])
def test_int4_steps_are_captured_on_the_int4_kernels(request, monkeypatch, scope, n):
    """INT4 decode steps (8 rows, and 160 past the decode rows) run every experts block on the grouped
    INT4 weight-only kernel and, with all linears INT4, the attention projections on the dense one,
    no weight dequantized in a step: the step is captured, replayed, and samples as the static engine
    does, bit for bit."""
    from skyq.rollout import quantized_linear as ql

    graph, static, cfg = _int4_engines(request, scope)
    graph.eos_token_id = static.eos_token_id = -1  # every row decodes every step: replays happen
    dense, grouped, dequantized = [], [], []
    real_dense, real_grouped, real_deq = (
        int4_mxfp8_linear.int4_weight_only_linear, int4_mxfp8_linear.int4_grouped_weight_only_linear, dispatch.dequantize_int4_packed,
    )  # fmt: skip
    monkeypatch.setattr(int4_mxfp8_linear, "int4_weight_only_linear",
                        lambda *a: dense.append(ql.in_decode_step()) or real_dense(*a))  # fmt: skip
    monkeypatch.setattr(int4_mxfp8_linear, "int4_grouped_weight_only_linear",
                        lambda *a: grouped.append(ql.in_decode_step()) or real_grouped(*a))  # fmt: skip
    monkeypatch.setattr(dispatch, "dequantize_int4_packed",
                        lambda *a, **k: dequantized.append(ql.in_decode_step()) or real_deq(*a, **k))  # fmt: skip
    prompts = [p.token_ids for p in build_task(cfg.task, seed=0).prompts(0, 2)]
    a = graph.generate(prompts, n=n, max_new_tokens=4, seed=0, **SAMPLING)
    assert all(d._graph is not None and d.replays > 0 for d in graph._decoders.values())
    assert grouped and all(grouped)
    assert all(dense) and bool(dense) == (scope == "all_linear")
    assert dequantized and not any(dequantized)  # prefill only
    assert a == static.generate(prompts, n=n, max_new_tokens=4, seed=0, **SAMPLING)


def test_int4_decode_kernels_give_the_dequantized_weights_logits(request, monkeypatch):
    """One INT4 decode step on the kernels (all linears INT4) against the same step with the kernels
    refused (each weight dequantized, the experts' loop): the logits agree within the bf16 rounding of
    a different fp32 summation order."""
    _, static, _ = _int4_engines(request, "all_linear")
    _assert_kernel_logits_near_the_refused_ones(static, monkeypatch, "int4_kernel_takes")


def test_a_non_finite_value_first_seen_in_a_replay_fails_generate(request):
    """Through `generate`, whose replays are checked one step late (the status copied without
    waiting): every embedding row but the prompt's turned NaN after the capture, so the first
    replayed step that feeds a sampled token outside the prompt quantizes NaN. The call raises a
    `QuantizationError`, as the static engine's does (there from the eager step's own check)."""
    graph, static, _, cfg = _engines(request, "fp8_blockwise")
    prompt = [1, 5, 13, 6, 18]
    for engine in (graph, static):
        engine.eos_token_id = -1  # every row decodes every step
        engine.generate([prompt], n=4, max_new_tokens=3, seed=0, **SAMPLING)  # captures the step
        with torch.inference_mode():
            emb = engine.model.get_input_embeddings().weight
            keep = emb[prompt].clone()
            emb.fill_(float("nan"))
            emb[prompt] = keep
        with pytest.raises(QuantizationError):
            engine.generate([prompt], n=4, max_new_tokens=12, seed=1, **SAMPLING)
    assert graph._decoders[(4, 64)].replays > 0


@pytest.mark.parametrize("precision", ["fp8_blockwise", "bf16"])
def test_q_k_v_in_one_launch_decode_as_three_launches_do(precision, monkeypatch):
    """A model whose q/k/v rows fill whole scale blocks (q 256, k/v 128 rows): the engine groups each
    block's q, k and v (`SharedInput`) and a graphed decode step computes them in one launch. The
    samples match an engine that computes the three on their own (same weights, the grouping turned
    off) token for token, log-probs within fp32 summation noise; and the shared path did run."""
    from skyq.config.enums import Precision
    from skyq.config.schema import ModelConfig, PrecisionConfig
    from skyq.quant.plan import build_plan
    from skyq.quant.strategies import get_strategy
    from skyq.rollout import quantized_linear
    from skyq.rollout.embedded import EmbeddedEngine

    model_cfg = ModelConfig(
        name="qkv", hidden_size=256, num_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        intermediate_size=512, moe_intermediate_size=128, num_experts=8, num_experts_per_tok=2, vocab_size=64,
        max_position_embeddings=256,
    )  # fmt: skip
    precision_cfg = PrecisionConfig(name=Precision(precision))
    strategy, gen = get_strategy(precision_cfg), torch.Generator().manual_seed(0)
    wire = {}
    for entry in build_plan(model_cfg, precision_cfg):
        w = (
            torch.ones(entry.shape)
            if len(entry.shape) == 1
            else torch.randn(entry.shape, generator=gen) * 0.05
        )
        w = w.to(entry.dtype).cuda()
        wire.update(
            strategy.serialize(entry.name, w, role=entry.role) if entry.quantized else {entry.name: w}
        )
    engines = []
    for _ in range(2):
        engine = EmbeddedEngine(model_cfg=model_cfg, precision_cfg=precision_cfg, device="cuda", seed=0)
        engine.load_weights(wire, version=0)
        engine.eos_token_id = -1
        engines.append(engine)
    groups = {id(m.shared) for m in engines[0].model.modules() if getattr(m, "shared", None) is not None}
    assert len(groups) == model_cfg.num_layers
    shared_calls = []
    real = quantized_linear.SharedInput._all
    monkeypatch.setattr(
        quantized_linear.SharedInput, "_all", lambda self, x: shared_calls.append(1) or real(self, x)
    )
    prompts = [[1, 5, 9, 13], [2, 6, 10, 14]]
    a = engines[0].generate(prompts, n=3, max_new_tokens=6, seed=4, **SAMPLING)
    assert shared_calls
    monkeypatch.setattr(quantized_linear.SharedInput, "applies", lambda self, x: False)
    b = engines[1].generate(prompts, n=3, max_new_tokens=6, seed=4, **SAMPLING)
    assert [s.response_ids for s in a] == [s.response_ids for s in b]
    diff = max(
        abs(x - y) for sa, sb in zip(a, b, strict=True) for x, y in zip(sa.logprobs, sb.logprobs, strict=True)
    )
    assert diff < 2e-2, diff


def test_prefill_and_decode_take_skyq_kernels_at_every_batch(request, monkeypatch):
    """The norm, rotary and router kernels (skyq.ops) are taken in prefill and in every decode
    step at 1 and 64 rows: a shape they refuse would fall back to the stock ops silently (the
    rotary once did at 64 rows, whose decode shares one row of cos / sin)."""
    from skyq.ops import rmsnorm, rotary, router

    graph, _, _, cfg = _engines(request, "fp8_blockwise")
    taken: dict[str, list[bool]] = {"rmsnorm": [], "rotary": [], "router": []}
    for name, module in (("rmsnorm", rmsnorm), ("rotary", rotary), ("router", router)):
        check = module._kernel_applies

        def spy(*args, _check=check, _name=name):
            taken[_name].append(_check(*args))
            return taken[_name][-1]

        monkeypatch.setattr(module, "_kernel_applies", spy)
    prompts = [p.token_ids for p in build_task(cfg.task, seed=0).prompts(0, 64)]
    for rows in (1, 64):
        graph.generate(prompts[:rows], n=1, max_new_tokens=4, seed=rows, **SAMPLING)
    assert all(taken.values()) and all(all(v) for v in taken.values()), {
        k: v.count(False) for k, v in taken.items()
    }
