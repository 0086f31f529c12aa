"""build_model on the CPU (local spec, gloo): tiny Qwen3-MoE and tiny MLA (DeepSeek-V3 family) models
train at world size 1, and TP2 + sequence parallel, EP2 and DP2 give the world-size-1 loss and
gradients on the same weights (the world-size-1 weights sliced into each rank's shards; megatron's
own DDP and `finalize_model_grads` reduce the gradients). MLA under TP2 is the layout whose
gradients megatron-core 0.16.1's local spec gets wrong (the rotary-key rows of
`linear_kv_down_proj`, the MLA norms); model.py replicates the down-projections.

Two spawned runs for the whole module (world size 1, then 2): each loads megatron-core afresh.
"""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed (dev extra, Python < 3.12)")

from dist_helpers import init_parallel, run_ranks  # noqa: E402

from skyq.config.enums import ComputeDtype, ModelFamily  # noqa: E402
from skyq.config.schema import ModelConfig, ParallelConfig, PrecisionConfig, TrainerConfig  # noqa: E402

SEED = 1234
BATCH, SEQ = 4, 8


def tiny_qwen() -> ModelConfig:
    return ModelConfig(
        name="tiny_qwen_test", family=ModelFamily.qwen3_moe, vocab_size=64, hidden_size=32, num_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=64,
        moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
    )  # fmt: skip


def tiny_mla() -> ModelConfig:
    return ModelConfig(
        name="tiny_mla_test", family=ModelFamily.deepseek_v3, vocab_size=64, hidden_size=32, num_layers=2,
        num_attention_heads=4, num_key_value_heads=4, intermediate_size=64, moe_intermediate_size=32,
        num_experts=4, num_experts_per_tok=2, num_shared_experts=1, first_k_dense_replace=1,
        q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
        max_position_embeddings=64, rope_theta=10000.0,
    )  # fmt: skip


MODELS = {"qwen": tiny_qwen, "mla": tiny_mla}
TRAINER = TrainerConfig(compute_dtype=ComputeDtype.fp32)
LAYOUTS = {  # name: (tp, ep, sequence_parallel); world size 2, dp = 2 / (tp)
    "tp2_sp": (2, 1, True),
    "ep2": (1, 2, False),
    "dp2": (1, 1, False),
}


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(SEED)
    tokens = torch.randint(0, 64, (BATCH, SEQ + 1), generator=gen)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


# --- what the spawned ranks run ----------------------------------------------------------------


def _build(model_cfg: ModelConfig, parallel: ParallelConfig, precision: PrecisionConfig | None = None):
    from skyq.trainer.megatron.model import build_model

    return build_model(model_cfg, precision or PrecisionConfig(), TRAINER, parallel, device="cpu", seed=SEED)


def _state(model) -> dict[str, torch.Tensor]:
    """Parameters and the router's expert_bias buffers, by name."""
    out = {n: p.detach().clone() for n, p in model.named_parameters()}
    out.update({n: b.detach().clone() for n, b in model.named_buffers() if n.endswith("expert_bias")})
    return out


def _grads(model, model_cfg: ModelConfig, parallel: ParallelConfig) -> tuple[float, dict[str, torch.Tensor]]:
    """(loss, {name: main_grad}) of one forward/backward through megatron's DDP, on this rank's
    data-parallel share of the batch, after `finalize_model_grads`."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads

    ddp = DistributedDataParallel(
        model.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model
    )
    ddp.zero_grad_buffer()
    tokens, labels = batch()
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    rows = slice(dp_rank * BATCH // dp, (dp_rank + 1) * BATCH // dp)
    tokens, labels = tokens[rows], labels[rows]
    positions = torch.arange(SEQ).expand_as(tokens)
    per_token = ddp(tokens, positions, None, labels=labels)
    loss = per_token.float().mean()
    loss.backward()
    finalize_model_grads([ddp])
    mean_loss = loss.detach().clone()
    torch.distributed.all_reduce(mean_loss, group=ps.get_data_parallel_group())
    grads = {n: p.main_grad.detach().clone() for n, p in model.named_parameters()}
    return float(mean_loss) / dp, grads


def _global_name(name: str, ep_rank: int, local_experts: int) -> str:
    match = re.search(r"local_experts\.(\d+)\.", name)
    if match is None:
        return name
    expert = ep_rank * local_experts + int(match.group(1))
    return name[: match.start(1)] + str(expert) + name[match.end(1) :]


def _local_piece(full: torch.Tensor, param: torch.Tensor, name: str, gated: bool) -> torch.Tensor:
    """This rank's piece of a full (world-size-1) tensor, after megatron's partition attributes."""
    from megatron.core import parallel_state as ps

    if not getattr(param, "tensor_model_parallel", False):
        return full
    if "local_experts" in name:
        rank, size = ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size()
    else:
        rank, size = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    dim = param.partition_dim
    if gated and name.endswith("linear_fc1.weight"):  # each rank holds [gate_r; up_r]
        return torch.cat([half.chunk(size, dim)[rank] for half in full.chunk(2, 0)])
    return full.chunk(size, dim)[rank]


def _cpu_compat_probes() -> dict[str, str]:
    """Each cpu_compat patch's megatron-core 0.16.1 caller, run once: "ok" or the exception's type."""
    import numpy as np
    from megatron.core import tensor_parallel
    from megatron.core.fusions import fused_softmax
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.transformer import multi_latent_attention
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    def stream_protocol():  # MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize's calls
        side = torch.cuda.Stream()
        if torch.cuda.current_stream() != side:
            side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            pass
        side.record_event().synchronize()

    def rng_tracker():
        tensor_parallel.model_parallel_cuda_manual_seed(SEED)
        with tensor_parallel.get_cuda_rng_tracker().fork():
            pass

    def mla_te_check():  # MLASelfAttention.__init__: HAVE_TE and isinstance(linear_proj, TELinear)
        assert not (
            multi_latent_attention.HAVE_TE
            and isinstance(torch.nn.Linear(1, 1), multi_latent_attention.TELinear)
        )

    def split_sizes():
        splits = token_dispatcher.maybe_move_tensor_to_cpu(torch.tensor([3, 1]), as_numpy=True)
        assert isinstance(splits, np.ndarray), type(splits)

    probes = {
        "current_device": lambda: RotaryEmbedding(8, 1.0, use_cpu_initialization=True)(8),
        "streams": stream_protocol,
        "rng": rng_tracker,
        "causal_mask": lambda: fused_softmax.get_default_causal_mask(4),
        "te_general_gemm": lambda: moe_utils.router_gating_linear(
            torch.randn(2, 4), torch.randn(3, 4), None, torch.float32
        ),
        "mla_have_te": mla_te_check,
        "split_sizes": split_sizes,
    }
    out = {}
    for name, probe in probes.items():
        try:
            probe()
            out[name] = "ok"
        except Exception as err:  # noqa: BLE001 - the probe records what the caller raises
            out[name] = type(err).__name__
    return out


def _recompute_matches() -> dict[str, bool]:
    """Activation recompute (full / selective) gives the same loss and gradients as none."""
    from skyq.config.enums import RecomputeGranularity
    from skyq.config.schema import RecomputeConfig
    from skyq.trainer.megatron.model import build_model

    tokens, labels = batch()
    positions = torch.arange(SEQ).expand_as(tokens)
    results = {}
    for granularity in ("none", "full", "selective"):
        trainer = TrainerConfig(
            compute_dtype=ComputeDtype.fp32,
            recompute=RecomputeConfig(granularity=RecomputeGranularity(granularity)),
        )
        model = build_model(tiny_mla(), PrecisionConfig(), trainer, ParallelConfig(), device="cpu", seed=SEED)
        model(tokens, positions, None, labels=labels).mean().backward()
        results[granularity] = [p.grad.clone() for p in model.parameters()]
        assert model.config.recompute_granularity == (None if granularity == "none" else granularity)
    return {
        g: all(torch.equal(a, b) for a, b in zip(results[g], results["none"])) for g in ("full", "selective")
    }


def ws1_worker(rank: int, ref_file: str) -> dict:
    """World size 1: cpu_compat's patches probed before and after `apply()`; each model trains one
    step (finite loss, gradients everywhere); its weights, loss and gradients are saved as the
    reference for the layouts."""
    from skyq.trainer.megatron import cpu_compat

    init_parallel(1, 1)
    before = _cpu_compat_probes()
    cpu_compat.apply()
    cpu_compat.apply()  # idempotent
    refs, summary = {}, {"cpu_compat": {"before": before, "after": _cpu_compat_probes()}}
    for kind, make in MODELS.items():
        model = _build(make(), ParallelConfig())
        state = _state(model)
        loss, grads = _grads(model, make(), ParallelConfig())
        refs[kind] = {"state": state, "loss": loss, "grads": grads}
        summary[kind] = {
            "loss": loss,
            "finite": all(bool(torch.isfinite(g).all()) for g in grads.values()),
            "zero_grads": sorted(n for n, g in grads.items() if not g.abs().sum()),
            "params": sorted(grads),
            "modules": sorted({type(m).__name__ for m in model.modules()}),
        }
    torch.save(refs, ref_file)
    qwen = _build(tiny_qwen(), ParallelConfig())
    tied = _build(ModelConfig(**{**vars(tiny_qwen()), "tie_word_embeddings": True}), ParallelConfig())
    summary["recompute"] = _recompute_matches()
    summary["shapes"] = {
        "embedding": list(qwen.embedding.word_embeddings.weight.shape),
        "output_layer": list(qwen.output_layer.weight.shape),
        "inv_freq": qwen.rotary_pos_emb.inv_freq.clone(),
        "tied_params": sorted(n for n, _ in tied.named_parameters()),
    }
    return summary


def ws2_worker(rank: int, ref_file: str, cases: list[tuple[str, str]]) -> dict:
    """World size 2: per (model, layout), the world-size-1 weights sliced into this rank's shards,
    one forward/backward, and the largest gradient difference from the reference."""
    from megatron.core import parallel_state as ps

    refs = torch.load(ref_file, weights_only=True)
    out = {}
    for kind, layout in cases:
        tp, ep, sp = LAYOUTS[layout]
        init_parallel(tp, ep)
        model_cfg = MODELS[kind]()
        parallel = ParallelConfig(tp=tp, ep=ep, sequence_parallel=sp)
        model = _build(model_cfg, parallel)
        ref = refs[kind]
        local_experts = model_cfg.num_experts // ep
        ep_rank = ps.get_expert_model_parallel_rank()
        with torch.no_grad():
            tensors = dict(model.named_parameters())
            tensors.update({n: b for n, b in model.named_buffers() if n.endswith("expert_bias")})
            for name, tensor in tensors.items():
                full = ref["state"][_global_name(name, ep_rank, local_experts)]
                tensor.copy_(_local_piece(full, tensor, name, gated=True))
        loss, grads = _grads(model, model_cfg, parallel)
        params = dict(model.named_parameters())
        worst, worst_name = 0.0, ""
        for name, grad in grads.items():
            full = ref["grads"][_global_name(name, ep_rank, local_experts)]
            expected = _local_piece(full, params[name], name, gated=True)
            diff = float((grad - expected).abs().max() / expected.abs().max().clamp_min(1e-12))
            if diff > worst:
                worst, worst_name = diff, name
        out[f"{kind}/{layout}"] = {"loss": loss, "ref_loss": ref["loss"], "worst": worst, "at": worst_name}
    return out


# --- tests -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ref_file():
    with tempfile.TemporaryDirectory(prefix="skyq-megatron-ref-") as d:
        yield str(Path(d) / "ref.pt")


@pytest.fixture(scope="module")
def ws1(ref_file):
    return run_ranks(ws1_worker, 1, ref_file)[0]


CASES = [
    ("qwen", "tp2_sp"),
    ("qwen", "ep2"),
    ("qwen", "dp2"),
    ("mla", "tp2_sp"),
    ("mla", "ep2"),
]


@pytest.fixture(scope="module")
def ws2(ws1, ref_file):
    results = run_ranks(ws2_worker, 2, ref_file, CASES)
    assert results[0] == results[1] or all(
        results[0][k]["loss"] == pytest.approx(results[1][k]["loss"], rel=1e-6) for k in results[0]
    )
    return results[0]


PATCHES = ["current_device", "streams", "rng", "causal_mask", "te_general_gemm", "mla_have_te", "split_sizes"]


@pytest.mark.parametrize("patch", PATCHES)
def test_each_cpu_compat_patch_makes_its_megatron_caller_work(ws1, patch):
    probes = ws1["cpu_compat"]
    assert probes["before"][patch] != "ok", f"{patch}: megatron-core's caller ran without the patch"
    assert probes["after"][patch] == "ok", f"{patch}: still fails after apply(): {probes['after'][patch]}"


def test_cpu_compat_is_a_no_op_on_a_cuda_torch(monkeypatch):
    from skyq.trainer.megatron import cpu_compat

    current_device = torch.cuda.current_device
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cpu_compat.apply()
    assert torch.cuda.current_device is current_device and not cpu_compat._APPLIED


@pytest.mark.parametrize("kind", ["qwen", "mla"])
def test_world_size_one_forward_backward_gives_finite_loss_and_gradients_everywhere(ws1, kind):
    s = ws1[kind]
    assert torch.isfinite(torch.tensor(s["loss"])) and 2.0 < s["loss"] < 8.0  # ~ln(64) at init
    assert s["finite"]
    assert not s["zero_grads"], f"{kind}: parameters without gradient: {s['zero_grads']}"


def test_vocab_is_exact_rope_base_is_the_models_and_embeddings_tie_on_request(ws1):
    shapes, model_cfg = ws1["shapes"], tiny_qwen()
    assert shapes["embedding"] == shapes["output_layer"] == [model_cfg.vocab_size, model_cfg.hidden_size]
    dims = torch.arange(0, model_cfg.head_dim, 2, dtype=torch.float32) / model_cfg.head_dim
    assert torch.allclose(shapes["inv_freq"], 1.0 / model_cfg.rope_theta**dims)
    assert "output_layer.weight" not in shapes["tied_params"]
    assert "embedding.word_embeddings.weight" in shapes["tied_params"]


@pytest.mark.parametrize("granularity", ["full", "selective"])
def test_activation_recompute_gives_the_same_gradients(ws1, granularity):
    assert ws1["recompute"][granularity]


def test_mla_model_uses_skyq_local_modules(ws1):
    modules = ws1["mla"]["modules"]
    assert {"LocalMLASelfAttention", "MLACoreAttention", "ReplicatedLinear", "SkyqRMSNorm"} <= set(modules)
    params = ws1["mla"]["params"]
    assert "decoder.layers.0.mlp.linear_fc1.weight" in params  # first_k_dense_replace=1: dense layer 0
    assert "decoder.layers.1.mlp.shared_experts.linear_fc1.weight" in params
    assert "decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.weight" in params


@pytest.mark.parametrize("case", [f"{k}/{lay}" for k, lay in CASES])
def test_parallel_layouts_match_world_size_one(ws2, case):
    r = ws2[case]
    assert r["loss"] == pytest.approx(r["ref_loss"], rel=1e-5, abs=1e-6)
    assert r["worst"] < 1e-5, (
        f"{case}: gradient of {r['at']} differs by {r['worst']:.3g} (relative to its max)"
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_is_the_hf_models_bit_for_bit(dtype):
    import types

    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRMSNorm

    from skyq.trainer.megatron.model import SkyqRMSNorm

    config = types.SimpleNamespace(normalization="RMSNorm", sequence_parallel=True)
    ours, hf = SkyqRMSNorm(config, 16, eps=1e-6).to(dtype), Qwen3MoeRMSNorm(16, eps=1e-6).to(dtype)
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        ours.weight.copy_(torch.randn(16, generator=gen))
        hf.weight.copy_(ours.weight)
    x = (torch.randn(3, 5, 16, generator=gen) * 4).to(dtype)
    assert torch.equal(ours(x), hf(x))
    assert ours.weight.sequence_parallel
