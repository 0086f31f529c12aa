"""precision=int4_qat in Megatron (skyq/trainer/megatron/fake_int4.py): the forward multiplies by
fq(W) (skyq's INT4 fake-quant of the bf16 weight), the weight gradient is dy^T x exactly, and with
Megatron's main_grad (TE's fused wgrad accumulation) the gradient lands in main_grad exactly once.

The straight-through estimator and the main_grad protocol run in-process (no megatron-core); the
local spec's linears and a whole int4_qat model run in one spawned megatron process.
"""

from __future__ import annotations

import weakref

import pytest
import torch

from skyq.config.enums import Int4Grid, ModelFamily, Precision, QuantScope
from skyq.config.schema import ModelConfig, ParallelConfig, PrecisionConfig, TrainerConfig
from skyq.quant import int4
from skyq.trainer.megatron.fake_int4 import Int4FakeQuant, Int4QatError


def int4_precision(group: int = 16, grid: Int4Grid = Int4Grid.kimi, scope=QuantScope.routed_experts):
    return PrecisionConfig(name=Precision.int4_qat, int4_group_size=group, int4_grid=grid, qat_scope=scope)


def reference_fq(w: torch.Tensor, group: int, grid: Int4Grid) -> torch.Tensor:
    """The rollout engine's weight: the bf16 weight quantized and dequantized by skyq.quant.int4."""
    q, scale = int4.quantize(w.detach().to(torch.bfloat16), group_size=group, grid=grid)
    return int4.dequantize(q, scale, group_size=group, dtype=w.dtype)


@pytest.mark.parametrize("grid", [Int4Grid.kimi, Int4Grid.rtn])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fake_quant_value_is_the_engines_int4_weight(grid, dtype):
    w = torch.randn(24, 64, generator=torch.Generator().manual_seed(3)).to(dtype)
    fq = Int4FakeQuant(int4_precision(group=32, grid=grid))
    out = fq(w)
    assert out.dtype == dtype
    assert torch.equal(out, reference_fq(w, 32, grid))
    assert not torch.equal(out, w)


def test_straight_through_gradient_is_the_incoming_gradient_exactly():
    gen = torch.Generator().manual_seed(4)
    w = torch.nn.Parameter(torch.randn(8, 32, generator=gen))
    x, dy = torch.randn(5, 32, generator=gen), torch.randn(5, 8, generator=gen)
    y = x @ Int4FakeQuant(int4_precision())(w).t()
    assert torch.equal(y, x @ reference_fq(w, 16, Int4Grid.kimi).t())
    y.backward(dy)
    assert torch.equal(w.grad, dy.t() @ x)


class _FusedWgradLinear(torch.autograd.Function):
    """What TE's GroupedLinear does with `fuse_wgrad_accumulation` (te 2.20 grouped_linear.py): it
    keeps weak references to the weight tensors it was given; in the backward it adds the weight
    gradient into their `main_grad` and, where they carry `grad_added_to_main_grad`, sets it and
    returns a dummy gradient (`get_dummy_wgrad`: uninitialised memory unless asked to zero it; NaN
    here, so adding it anywhere shows), else returns None. What it saved is freed when its
    backward ends, as autograd does for TE."""

    @staticmethod
    def forward(ctx, x, weight, fuse: bool):
        ctx.save_for_backward(x, weight)
        ctx.weight_ref, ctx.fuse = weakref.ref(weight), fuse
        return x @ weight.t()

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        wgrad = dy.t() @ x
        if not ctx.fuse:
            return dy @ weight, wgrad, None
        origin = ctx.weight_ref()
        origin.main_grad.add_(wgrad)
        if hasattr(origin, "grad_added_to_main_grad"):
            origin.grad_added_to_main_grad = True
            return dy @ weight, torch.full_like(weight, float("nan")), None
        return dy @ weight, None, None


def _ddp_hook(param: torch.nn.Parameter) -> None:
    """Megatron DDP's grad hook (distributed_data_parallel.py, `_make_backward_post_hook`)."""
    assert param.grad is not None, "overlap_grad_reduce: the hook fired without a gradient"
    if not param.grad_added_to_main_grad:
        param.main_grad.add_(param.grad.data)
    param.grad = None


@pytest.mark.parametrize("fuse", [False, True], ids=["unfused", "fused_wgrad"])
def test_main_grad_gets_the_weight_gradient_exactly_once(fuse):
    gen = torch.Generator().manual_seed(5)
    w = torch.nn.Parameter(torch.randn(8, 32, generator=gen))
    w.main_grad = torch.zeros_like(w)
    w.grad_added_to_main_grad = False
    x, dy = torch.randn(6, 32, generator=gen), torch.randn(6, 8, generator=gen)
    for _ in range(2):  # two micro-batches accumulate
        y = _FusedWgradLinear.apply(x, Int4FakeQuant(int4_precision())(w), fuse)
        y.backward(dy)
        _ddp_hook(w)
    assert torch.equal(w.main_grad, 2 * (dy.t() @ x))


def test_refuses_groups_straddling_shards_and_stacked_weights():
    fq = Int4FakeQuant(int4_precision(group=32))
    with pytest.raises(Int4QatError, match="K = 48 is not a multiple of precision.int4_group_size=32"):
        fq(torch.randn(4, 48), "experts.linear_fc2.weight0")
    with pytest.raises(Int4QatError, match="single_grouped_weight"):
        fq(torch.randn(2, 4, 64))
    with pytest.raises(Int4QatError, match="precision=int4_qat"):
        Int4FakeQuant(PrecisionConfig())


# --- megatron-core, one spawned rank -----------------------------------------------------------


def tiny(family: ModelFamily) -> ModelConfig:
    common = dict(
        vocab_size=64, hidden_size=32, num_layers=2, num_attention_heads=4, intermediate_size=64,
        moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
    )  # fmt: skip
    if family is ModelFamily.qwen3_moe:
        return ModelConfig(name="tiny_qwen_int4", family=family, num_key_value_heads=2, head_dim=8, **common)
    return ModelConfig(
        name="tiny_mla_int4", family=family, num_key_value_heads=4, num_shared_experts=1,
        first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=8, v_head_dim=8, **common,
    )  # fmt: skip


def _layers(results: dict) -> None:
    """Int4 Column/RowParallelLinear: forward == x @ fq(W)^T and W.grad == dy^T x, bit for bit."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    from skyq.trainer.megatron.fake_int4 import local_int4_linears

    config = TransformerConfig(
        num_layers=1, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True
    )
    col, row = local_int4_linears()
    gen = torch.Generator().manual_seed(6)
    for cls, kwargs in ((col, {"gather_output": False}), (row, {"input_is_parallel": True})):
        layer = cls(
            64, 48, config=config, init_method=torch.nn.init.normal_, bias=False, skip_bias_add=False,
            precision_cfg=int4_precision(), **kwargs,
        )  # fmt: skip
        x = torch.randn(5, 3, 64, generator=gen, requires_grad=True)
        dy = torch.randn(5, 3, 48, generator=gen)
        y, _ = layer(x)
        expected = x.detach() @ reference_fq(layer.weight, 16, Int4Grid.kimi).t()
        y.backward(dy)
        wgrad = dy.reshape(-1, 48).t().matmul(x.detach().reshape(-1, 64))
        results[cls.__name__] = {
            "forward_equal": torch.equal(y.detach(), expected),
            "grad_equal": torch.equal(layer.weight.grad, wgrad),
            "weight_names": [n for n, _ in layer.named_parameters()],
        }


def _fq_matches_prequantized(results: dict) -> None:
    """An int4_qat model's logits equal a bf16 model's whose routed-expert weights were replaced by
    fq(W): only the routed experts are fake-quantized, and they compute with exactly fq(W)."""
    from skyq.trainer.megatron.model import build_model

    trainer = TrainerConfig(compute_dtype="fp32")
    model_cfg = tiny(ModelFamily.qwen3_moe)
    qat = build_model(model_cfg, int4_precision(), trainer, ParallelConfig(), device="cpu", seed=7)
    plain = build_model(model_cfg, PrecisionConfig(), trainer, ParallelConfig(), device="cpu", seed=7)
    with torch.no_grad():
        for (name, p), (_, q) in zip(qat.named_parameters(), plain.named_parameters()):
            q.copy_(reference_fq(p, 16, Int4Grid.kimi) if ".experts." in name else p)
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(8))
    positions = torch.arange(8).expand(2, 8)
    results["logits_equal"] = torch.equal(qat(tokens, positions, None), plain(tokens, positions, None))


def _trains(results: dict) -> None:
    """Three SGD steps of each int4_qat model: finite falling loss, gradients on every parameter."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads

    from skyq.trainer.megatron.model import build_model

    trainer = TrainerConfig(compute_dtype="fp32")
    tokens = torch.randint(0, 64, (4, 9), generator=torch.Generator().manual_seed(9))
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    positions = torch.arange(8).expand(4, 8)
    for family, scope in ((ModelFamily.qwen3_moe, QuantScope.routed_experts), (ModelFamily.deepseek_v3, QuantScope.all_linear)):  # fmt: skip
        model = build_model(
            tiny(family), int4_precision(scope=scope), trainer, ParallelConfig(), device="cpu", seed=10
        )
        # through megatron's DDP (main_grad buffers and its grad hooks), as the worker trains
        ddp = DistributedDataParallel(
            model.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model
        )
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        losses, zero = [], set()
        for _ in range(3):
            ddp.zero_grad_buffer()
            loss = ddp(inputs, positions, None, labels=labels).mean()
            loss.backward()
            finalize_model_grads([ddp])
            for p in model.parameters():
                p.grad = p.main_grad
            zero |= {n for n, p in model.named_parameters() if not p.main_grad.abs().sum()}
            opt.step()
            losses.append(float(loss))
        quantized = sorted(
            n
            for n, m in model.named_modules()
            if type(m).__name__.startswith("Int4") or getattr(m, "fake_quant", None) is not None
        )
        results[f"{family.value}/{scope.value}"] = {
            "losses": losses,
            "zero_grads": sorted(zero),
            "quantized": quantized,
        }


def megatron_worker(rank: int) -> dict:
    from dist_helpers import init_parallel

    init_parallel(1, 1)
    results: dict = {}
    _layers(results)
    _fq_matches_prequantized(results)
    _trains(results)
    return results


@pytest.fixture(scope="module")
def megatron_results():
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (dev extra, Python < 3.12)")
    from dist_helpers import run_ranks

    return run_ranks(megatron_worker, 1)[0]


@pytest.mark.parametrize("cls", ["Int4ColumnParallelLinear", "Int4RowParallelLinear"])
def test_local_expert_linear_forward_and_weight_gradient_are_exact(megatron_results, cls):
    r = megatron_results[cls]
    assert r["forward_equal"], f"{cls}: forward != x @ fq(W)^T"
    assert r["grad_equal"], f"{cls}: weight grad != dy^T x"
    assert r["weight_names"] == ["weight"]  # the plain Megatron layer's parameter names


def test_int4_model_computes_with_fake_quantized_routed_experts_only(megatron_results):
    assert megatron_results["logits_equal"]


@pytest.mark.parametrize("case", ["qwen3_moe/routed_experts", "deepseek_v3/all_linear"])
def test_int4_qat_model_trains(megatron_results, case):
    r = megatron_results[case]
    assert all(torch.isfinite(torch.tensor(r["losses"]))), r["losses"]
    assert r["losses"][-1] < r["losses"][0], r["losses"]
    assert not r["zero_grads"], r["zero_grads"]
    quantized = r["quantized"]
    if case.endswith("routed_experts"):
        assert quantized and all(".mlp.experts.local_experts." in n for n in quantized), quantized
    else:
        for part in ("linear_kv_down_proj", "linear_q_up_proj", "linear_proj", "shared_experts.linear_fc1",
                     "layers.0.mlp.linear_fc2", "local_experts.3.linear_fc1"):  # fmt: skip
            assert any(part in n for n in quantized), (part, quantized)
        assert not any("output_layer" in n or "router" in n for n in quantized)


# --- TE spec surgery (GPU code path; TE stand-ins on the CPU) ---------------------------------


class _FakeTEGrouped(torch.nn.Module):
    """Stands in for TE's GroupedLinear: per-expert parameters `weight{i}`, read by the forward
    through `_get_weight_tensors()` (te 2.20 grouped_linear.py)."""

    def __init__(self, num_gemms: int = 2, in_features: int = 32, out_features: int = 8, **kwargs) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(11)
        for i in range(num_gemms):
            self.register_parameter(
                f"weight{i}", torch.nn.Parameter(torch.randn(out_features, in_features, generator=gen))
            )
        self.num_gemms = num_gemms

    def _get_weight_tensors(self):
        return [getattr(self, f"weight{i}") for i in range(self.num_gemms)]


class _FakeTECol(_FakeTEGrouped):
    pass


class _FakeTERow(_FakeTEGrouped):
    pass


@pytest.fixture
def te_stand_ins(monkeypatch):
    ext = pytest.importorskip("megatron.core.extensions.transformer_engine")
    from skyq.trainer.megatron import fake_int4

    monkeypatch.setattr(ext, "TEColumnParallelGroupedLinear", _FakeTECol)
    monkeypatch.setattr(ext, "TERowParallelGroupedLinear", _FakeTERow)
    fake_int4.te_int4_grouped_linears.cache_clear()
    yield
    fake_int4.te_int4_grouped_linears.cache_clear()


def _te_like_block(model_cfg: ModelConfig):
    """The local spec's layers with the routed experts' linears set to the TE stand-ins (the TE spec
    itself needs TE to build)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_layer_specs
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from skyq.trainer.megatron.config import transformer_config
    from skyq.trainer.megatron.model import _swap

    config = transformer_config(model_cfg, PrecisionConfig(), TrainerConfig(), ParallelConfig(), device="cpu")
    layers = []
    for layer in get_gpt_decoder_layer_specs(config, use_transformer_engine=False, normalization="RMSNorm"):
        layer = _swap(layer, {})
        if layer.submodules.mlp.module is MoELayer:
            experts = layer.submodules.mlp.submodules.experts.submodules
            experts.linear_fc1, experts.linear_fc2 = _FakeTECol, _FakeTERow
        layers.append(layer)
    return TransformerBlockSubmodules(layer_specs=layers, layer_norm=None)


def test_te_spec_experts_become_fake_int4_grouped_linears(te_stand_ins):
    from skyq.trainer.megatron.model import _module_of, _swap_te_experts

    precision = int4_precision()
    spec = _te_like_block(tiny(ModelFamily.deepseek_v3))
    _swap_te_experts(spec, precision)
    dense, moe = spec.layer_specs  # first_k_dense_replace=1
    assert dense.submodules.mlp.submodules.linear_fc1 is not None
    assert "Int4" not in str(dense.submodules.mlp.submodules.linear_fc1)
    fc1, fc2 = (
        moe.submodules.mlp.submodules.experts.submodules.linear_fc1,
        moe.submodules.mlp.submodules.experts.submodules.linear_fc2,
    )
    fc1, fc2 = _module_of(fc1), _module_of(fc2)  # classes with the precision bound
    assert issubclass(fc1, _FakeTECol) and issubclass(fc2, _FakeTERow)
    shared = moe.submodules.mlp.submodules.shared_experts.submodules.linear_fc1
    assert "Int4" not in str(shared)  # routed experts only
    layer = fc1()
    weights = layer._get_weight_tensors()
    assert [n for n, _ in layer.named_parameters()] == ["weight0", "weight1"]
    for w, param in zip(weights, (layer.weight0, layer.weight1)):
        assert torch.equal(w, reference_fq(param, 16, Int4Grid.kimi))
    sum((w * 1.5).sum() for w in weights).backward()
    assert torch.equal(layer.weight0.grad, torch.full_like(layer.weight0, 1.5))


def test_te_spec_refuses_int4_on_all_linears(te_stand_ins):
    from skyq.trainer.megatron.config import MegatronConfigError
    from skyq.trainer.megatron.model import _swap_te_experts

    spec = _te_like_block(tiny(ModelFamily.qwen3_moe))
    with pytest.raises(MegatronConfigError, match="precision.qat_scope=all_linear on the GPU"):
        _swap_te_experts(spec, int4_precision(scope=QuantScope.all_linear))


def test_te_spec_swap_takes_megatron_019_partial_specs(te_stand_ins):
    """megatron-core 0.19 writes the MoE and expert specs as functools.partial(Module, submodules=...)
    and calls the expert linear classes directly: the swap reaches them there too (found on the H200)."""
    import functools

    from skyq.trainer.megatron.model import _module_of, _submodules_of, _swap_te_experts

    precision = int4_precision()
    spec = _te_like_block(tiny(ModelFamily.deepseek_v3))
    for layer in spec.layer_specs:
        mlp = layer.submodules.mlp
        if mlp.submodules is not None and hasattr(mlp.submodules, "experts"):
            experts = mlp.submodules.experts
            mlp.submodules.experts = functools.partial(experts.module, submodules=experts.submodules)
            layer.submodules.mlp = functools.partial(mlp.module, submodules=mlp.submodules)
    _swap_te_experts(spec, precision)
    experts = _submodules_of(_submodules_of(spec.layer_specs[1].submodules.mlp).experts)
    assert issubclass(_module_of(experts.linear_fc1), _FakeTECol)
    assert issubclass(_module_of(experts.linear_fc2), _FakeTERow)
    assert "Int4" in _module_of(experts.linear_fc1)().__class__.__mro__[1].__name__
