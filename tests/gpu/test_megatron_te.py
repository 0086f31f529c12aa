"""trainer=megatron on a GPU: Transformer Engine's spec, its FP8 recipes and skyq's fake-INT4 grouped experts.

Needs CUDA, megatron-core and Transformer Engine (on the lent H200: staged, docs/gpu_box.md); skipped
elsewhere. One world of one rank (NCCL) for the module.

The fake-INT4 check compares two models with the same weights: A is precision=int4_qat (TE's grouped
expert linears swapped for skyq's subclasses, which compute with fq(W) and pass the gradient straight
through), B is bf16 whose expert weights ARE fq(W). Their forwards must be equal and A's expert
gradients equal to B's (the gradient with respect to fq(W)), both with Megatron's
gradient_accumulation_fusion off and on: on, TE adds the weight gradient into the parameter's
`main_grad` itself, and a naive straight-through estimator either starves that buffer (zero) or
lets Megatron's DDP hook add it a second time (twice B's).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("transformer_engine.pytorch")
pytest.importorskip("megatron.core")

import torch.distributed as dist  # noqa: E402

from skyq.config.store import compose, to_object  # noqa: E402
from skyq.trainer.megatron import model as megatron_model  # noqa: E402
from skyq.trainer.megatron.fake_int4 import Int4FakeQuant  # noqa: E402
from skyq.trainer.megatron.group import open_world_store  # noqa: E402

SHAPE = [
    "model=tiny_moe", "model.hidden_size=256", "model.moe_intermediate_size=256", "model.num_layers=2",
    "model.vocab_size=128", "model.head_dim=64", "model.num_attention_heads=4", "model.num_key_value_heads=2",
    "model.num_experts=4", "model.num_experts_per_tok=2", "topology=1gpu", "trainer=megatron",
]  # fmt: skip


@pytest.fixture(scope="module")
def world():
    from megatron.core import parallel_state

    dist.init_process_group("nccl", store=open_world_store(1, 120.0), rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    yield
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def _cfg(precision: str):
    return to_object(compose([*SHAPE, f"precision={precision}"]))


def _build(precision: str, fusion: bool):
    """This precision's GPTModel on the GPU, its TE linears accumulating weight gradients into
    `main_grad` themselves iff `fusion`. Megatron's own (non-TE) output layer refuses
    gradient_accumulation_fusion without Apex's fused kernel, so where that is missing the model is
    built without it and TE's modules are switched to fused accumulation after construction: the
    path under test is TE's (and skyq's STE inside it), not the output layer's."""
    cfg = _cfg(precision)
    build = dict(device="cuda", seed=0)
    try:
        model = megatron_model.build_model(
            cfg.model,
            cfg.precision,
            cfg.trainer,
            cfg.topology.parallel,
            gradient_accumulation_fusion=fusion,
            **build,
        )
    except RuntimeError:
        if not fusion:
            raise
        model = megatron_model.build_model(
            cfg.model,
            cfg.precision,
            cfg.trainer,
            cfg.topology.parallel,
            gradient_accumulation_fusion=False,
            **build,
        )
        switched = 0
        for module in model.modules():
            if type(module).__module__.startswith(("transformer_engine", "megatron.core.extensions")) or any(
                c.__module__.startswith("transformer_engine") for c in type(module).__mro__
            ):
                if hasattr(module, "fuse_wgrad_accumulation"):
                    module.fuse_wgrad_accumulation = True
                    switched += 1
        assert switched, "no Transformer Engine linear found to switch to fused weight-gradient accumulation"
    return cfg, model.cuda()


def _ddp(model):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    return DistributedDataParallel(
        model.config,
        DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False),
        model,
    )


def _grads(ddp, ids, weight):
    """main_grad of every parameter after one backward of sum(logits * weight)."""
    ddp.zero_grad_buffer()
    positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    logits = ddp(input_ids=ids, position_ids=positions, attention_mask=None)
    (logits.float() * weight).sum().backward()
    return logits.detach(), {n: p.main_grad.detach().clone() for n, p in ddp.module.named_parameters()}


@pytest.mark.parametrize("fusion", [False, True], ids=["fusion_off", "fusion_on"])
def test_int4_grouped_experts_compute_with_fq_and_pass_the_gradient_straight_through(world, fusion):
    cfg_a, a = _build("int4_qat", fusion)
    _, b = _build("bf16", fusion)
    b.load_state_dict(a.state_dict())
    fq = Int4FakeQuant(cfg_a.precision)
    experts = [n for n, _ in a.named_parameters() if ".mlp.experts.linear_fc" in n]
    assert experts, "the TE spec's grouped expert weights (linear_fc1.weight0 ...) were not found"
    with torch.no_grad():
        for name, p in b.named_parameters():
            if name in experts:
                p.copy_(fq.value(p, name))
    gen = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.randint(0, 128, (4, 32), device="cuda", generator=gen)
    weight = torch.randn(4, 32, 128, device="cuda", generator=gen)
    logits_a, grads_a = _grads(_ddp(a), ids, weight)
    logits_b, grads_b = _grads(_ddp(b), ids, weight)
    torch.testing.assert_close(logits_a, logits_b, rtol=0, atol=0)
    for name in experts:
        assert grads_b[name].abs().sum() > 0, name
        torch.testing.assert_close(grads_a[name], grads_b[name], rtol=1e-3, atol=1e-5, msg=name)
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], rtol=1e-3, atol=1e-5, msg=name)


def test_fp8_blockwise_forward_and_backward_track_bf16(world):
    """TE Float8BlockScaling on every linear (fp8_targets=all_linear): the logits stay within a few
    per cent of bf16's on the same weights, and every gradient is finite and non-zero."""
    _, fp8 = _build("fp8_blockwise", fusion=True)
    _, bf16 = _build("bf16", fusion=True)
    bf16.load_state_dict(fp8.state_dict(), strict=False)
    gen = torch.Generator(device="cuda").manual_seed(1)
    ids = torch.randint(0, 128, (4, 128), device="cuda", generator=gen)
    weight = torch.randn(4, 128, 128, device="cuda", generator=gen)
    logits_q, grads_q = _grads(_ddp(fp8), ids, weight)
    logits_r, _ = _grads(_ddp(bf16), ids, weight)
    rel = (logits_q.float() - logits_r.float()).norm() / logits_r.float().norm()
    assert 0 < rel < 0.1, f"fp8 vs bf16 logits relative error {rel:.4f}"
    for name, g in grads_q.items():
        assert torch.isfinite(g).all(), name


def test_te_reads_the_scale_grid_at_import_and_te_env_checks_it():
    """The real TE: NVTE_FP8_BLOCK_SCALING_FP32_SCALES set before the import gives fp32 scales and passes
    `te_env.check`; TE imported without it keeps power-of-two scales, which `check` refuses."""
    import os
    import subprocess
    import sys

    probe = (
        "import transformer_engine.pytorch\n"
        "from skyq.trainer.megatron import te_env\n"
        "te_env.check({te_env.FP32_SCALES: '1'})\n"
        "print('checked')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "NVTE_FP8_BLOCK_SCALING_FP32_SCALES"}
    ok = subprocess.run([sys.executable, "-c", probe], env={**env, "NVTE_FP8_BLOCK_SCALING_FP32_SCALES": "1"},
                        capture_output=True, text=True)  # fmt: skip
    assert ok.returncode == 0 and "checked" in ok.stdout, ok.stderr[-2000:]
    late = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True)
    assert late.returncode != 0 and "different grid" in late.stderr, late.stderr[-2000:]
