"""Tiny model configs, random HF checkpoints and real megatron-core GPTModels (local spec, CPU) for
tests/megatron/test_mapping.py, plus a small gloo launcher (`run_ranks`) for world sizes 1 and 2.

No `__init__.py` in tests/megatron: with one, pytest's `tests/` path entry would make this folder a
regular package named `megatron` and hide megatron-core.
"""

from __future__ import annotations

import json
import os
import socket
from datetime import timedelta
from pathlib import Path

import torch

from skyq.config.enums import ModelFamily
from skyq.config.schema import ModelConfig
from skyq.trainer.megatron.mapping.tables import hf_text_specs


def qwen_cfg(**overrides) -> ModelConfig:
    fields = dict(
        family=ModelFamily.qwen3_moe, vocab_size=64, hidden_size=32, num_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
    )  # fmt: skip
    return ModelConfig(**{**fields, **overrides})


def deepseek_cfg(**overrides) -> ModelConfig:
    fields = dict(
        family=ModelFamily.deepseek_v3, vocab_size=64, hidden_size=32, num_layers=2, num_attention_heads=4,
        intermediate_size=48, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
        num_shared_experts=1, first_k_dense_replace=1, q_lora_rank=12, kv_lora_rank=10,
        qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
    )  # fmt: skip
    return ModelConfig(**{**fields, **overrides})


def random_hf(model_cfg: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """Fresh random HF tensors for every text-model name of the layout, in its dtypes."""
    gen = torch.Generator().manual_seed(seed)
    return {
        name: torch.randn(spec.shape, generator=gen).to(spec.dtype)
        for name, spec in hf_text_specs(model_cfg).items()
    }


def write_checkpoint(directory: Path, tensors: dict[str, torch.Tensor], shards: int = 2) -> Path:
    """`tensors` as `shards` safetensors files plus the index, the way HF saves a sharded checkpoint."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    names = list(tensors)
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n].contiguous() for n in names[i::shards]}
        save_file(part, str(directory / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return directory


class _NoCoreAttention(torch.nn.Module):
    """Stands in for the core attention (no parameters) of MLA layers: megatron-core 0.16.1's local
    `DotProductAttention` does not take MLA's `k_channels`. These tests only build and load models."""

    def __init__(self, **kwargs) -> None:
        super().__init__()


def build_local_model(model_cfg: ModelConfig, *, tp: int, ep: int, sequence_parallel: bool = False):
    """A real GPTModel with the local spec on the CPU for the parallel layout already initialized."""
    import torch.nn.functional as F
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer import multi_latent_attention
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    from skyq.trainer.megatron import cpu_compat

    cpu_compat.apply()
    common = dict(
        num_layers=model_cfg.num_layers, hidden_size=model_cfg.hidden_size,
        num_attention_heads=model_cfg.num_attention_heads, normalization="RMSNorm",
        layernorm_epsilon=model_cfg.rms_norm_eps, gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, qk_layernorm=True, num_moe_experts=model_cfg.num_experts,
        moe_ffn_hidden_size=model_cfg.moe_intermediate_size, moe_router_topk=model_cfg.num_experts_per_tok,
        moe_token_dispatcher_type="allgather", use_cpu_initialization=True,
        ffn_hidden_size=model_cfg.intermediate_size, tensor_model_parallel_size=tp,
        expert_model_parallel_size=ep, sequence_parallel=sequence_parallel,
    )  # fmt: skip
    if model_cfg.family is ModelFamily.qwen3_moe:
        config = TransformerConfig(
            num_query_groups=model_cfg.num_key_value_heads, kv_channels=model_cfg.head_dim, **common
        )
    else:
        # 0.16.1 imports TELinear as None without Transformer Engine yet believes it has it; MLA's
        # constructor then calls isinstance(x, None).
        multi_latent_attention.HAVE_TE = False
        k = model_cfg.first_k_dense_replace
        config = MLATransformerConfig(
            q_lora_rank=model_cfg.q_lora_rank, kv_lora_rank=model_cfg.kv_lora_rank,
            qk_head_dim=model_cfg.qk_nope_head_dim, qk_pos_emb_head_dim=model_cfg.qk_rope_head_dim,
            v_head_dim=model_cfg.v_head_dim, rope_type="rope",
            moe_layer_freq=[0] * k + [1] * (model_cfg.num_layers - k),
            moe_shared_expert_intermediate_size=(
                model_cfg.moe_intermediate_size * model_cfg.num_shared_experts or None
            ),
            moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True, **common,
        )  # fmt: skip
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    if model_cfg.family is ModelFamily.deepseek_v3:
        for layer_spec in spec.layer_specs:
            layer_spec.submodules.self_attention.submodules.core_attention = _NoCoreAttention
    return GPTModel(
        config, spec, vocab_size=model_cfg.vocab_size, max_sequence_length=64,
        position_embedding_type="rope" if model_cfg.family is ModelFamily.qwen3_moe else "none",
        share_embeddings_and_output_weights=model_cfg.tie_word_embeddings,
    )  # fmt: skip


def init_parallel(tp: int, ep: int) -> None:
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from skyq.trainer.megatron import cpu_compat

    cpu_compat.apply()
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep)
    model_parallel_cuda_manual_seed(0)  # the forward's dropout RNG fork needs the tracker's states


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, fn, world_size: int, port: int, args: tuple) -> None:
    import torch.distributed as dist

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=120))
    try:
        fn(rank, *args)
    finally:
        from megatron.core import parallel_state as ps

        ps.destroy_model_parallel()
        dist.destroy_process_group()


def run_ranks(fn, world_size: int, *args) -> None:
    """Run `fn(rank, *args)` in `world_size` fresh processes joined by gloo; a rank's error re-raises."""
    import torch.multiprocessing as mp

    mp.spawn(_entry, args=(fn, world_size, _free_port(), args), nprocs=world_size, join=True)


# What the spawned ranks run (module-level, so that torch.multiprocessing can pickle them).


def describe_local_models(rank: int, out: str, cases: list[tuple[str, ModelConfig]]) -> None:
    """Build each case's local-spec model (TP1, EP1) and write every tensor's name, shape and
    megatron-core's partition attributes as JSON: {case: {name: [shape, partition_dim or None]}}."""
    from skyq.trainer.megatron.mapping import model_tensors

    init_parallel(1, 1)
    described = {}
    for label, model_cfg in cases:
        model = build_local_model(model_cfg, tp=1, ep=1)
        described[label] = {
            name: [list(t.shape), t.partition_dim if getattr(t, "tensor_model_parallel", False) else None]
            for name, t in model_tensors(model).items()
        }
    Path(out).write_text(json.dumps(described))


def _logits(model, model_cfg: ModelConfig, tp: int) -> torch.Tensor:
    """The model's logits on fixed tokens, gathered over the TP group's vocab shards."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    tokens = torch.arange(12).reshape(2, 6) % model_cfg.vocab_size
    model.eval()
    with torch.no_grad():
        out = model(tokens, torch.arange(6).expand(2, 6), None)
    if tp == 1:
        return out
    pieces = [torch.empty_like(out) for _ in range(tp)]
    dist.all_gather(pieces, out.contiguous(), group=ps.get_tensor_model_parallel_group())
    return torch.cat(pieces, dim=-1)


def load_and_export(rank: int, cases: list[tuple[ModelConfig, int, int, bool, str]]) -> None:
    """Per case (model config, tp, ep, sequence_parallel, HF dir): load the checkpoint into a fresh
    local-spec model, check every loaded tensor against `shard` of `hf_to_megatron` (the pure path),
    then check that `export_hf` gives back exactly the checkpoint, in layer order, on every rank.

    Qwen3 models (whose local-spec forward runs on the CPU) also compute logits: every layout of one
    checkpoint must give the logits of its first layout, which checks the slicing against what
    megatron-core's parallel layers compute (QKV groups, SwiGLU halves, row/column dims, experts)."""
    from megatron.core import parallel_state as ps
    from safetensors.torch import load_file

    from skyq.trainer.megatron.mapping import (
        export_hf,
        global_name,
        hf_to_megatron,
        load_hf_checkpoint,
        model_tensors,
        shard,
    )

    reference: dict[str, torch.Tensor] = {}
    for model_cfg, tp, ep, sequence_parallel, hf_dir in cases:
        init_parallel(tp, ep)
        original: dict[str, torch.Tensor] = {}
        for file in sorted(Path(hf_dir).glob("*.safetensors")):
            original.update(load_file(str(file)))
        model = build_local_model(model_cfg, tp=tp, ep=ep, sequence_parallel=sequence_parallel)
        load_hf_checkpoint(model, hf_dir, model_cfg, "local")

        full = hf_to_megatron(original, model_cfg, "local")
        ranks = dict(
            tp_rank=ps.get_tensor_model_parallel_rank(), tp_size=tp,
            ep_rank=ps.get_expert_model_parallel_rank(), ep_size=ep,
            etp_rank=ps.get_expert_tensor_parallel_rank(), etp_size=ps.get_expert_tensor_parallel_world_size(),
        )  # fmt: skip
        for local, tensor in model_tensors(model).items():
            name = global_name(local, model_cfg, ranks["ep_rank"], ep)
            expected = shard(name, full[name], model_cfg, **ranks)
            assert expected is not None, f"rank {rank}: {local} is not this rank's"
            assert torch.equal(tensor.detach(), expected.to(tensor.dtype)), (
                f"rank {rank}: {local} loaded wrong"
            )

        if model_cfg.family is ModelFamily.qwen3_moe:
            logits = _logits(model, model_cfg, tp)
            first = reference.setdefault(hf_dir, logits)
            assert torch.allclose(logits, first, rtol=1e-4, atol=1e-4), (
                f"rank {rank} tp{tp} ep{ep}: logits differ from the first layout's by "
                f"{(logits - first).abs().max():.3g}"
            )

        exported = list(export_hf(model, model_cfg, "local"))
        names = [n for n, _ in exported]
        assert len(names) == len(set(names)), f"rank {rank}: duplicate exported names"
        assert set(names) == set(original), (
            f"rank {rank} tp{tp} ep{ep}: missing {sorted(set(original) - set(names))[:3]}, "
            f"extra {sorted(set(names) - set(original))[:3]}"
        )
        for name, tensor in exported:
            assert tensor.dtype == original[name].dtype, f"{name}: {tensor.dtype}"
            assert torch.equal(tensor, original[name]), f"rank {rank} tp{tp} ep{ep}: {name} differs"
        layer_order = [int(n.split("layers.")[1].split(".")[0]) for n in names if ".layers." in n]
        assert layer_order == sorted(layer_order), f"rank {rank}: export not grouped by layer"
