"""Tiny model configs, random HF checkpoints, and what the spawned gloo ranks of
tests/megatron/test_mapping.py run on skyq's Megatron models (`skyq.trainer.megatron.model.build_model`,
local spec on the CPU; launched by tests/megatron/dist_helpers.run_ranks)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from dist_helpers import init_parallel

from skyq.config.enums import ComputeDtype, ModelFamily
from skyq.config.schema import ModelConfig, ParallelConfig, PrecisionConfig, TrainerConfig
from skyq.trainer.megatron.mapping.tables import hf_text_specs

TRAINER = TrainerConfig(compute_dtype=ComputeDtype.fp32)


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


def build(model_cfg: ModelConfig, *, tp: int, ep: int):
    """skyq's own Megatron model (local spec, fp32 parameters) for the parallel layout, after
    `init_parallel(tp, ep)`; MLA with tp > 1 runs with sequence parallelism, as skyq requires."""
    from skyq.trainer.megatron.model import build_model

    sequence_parallel = tp > 1 and model_cfg.family is ModelFamily.deepseek_v3
    parallel = ParallelConfig(tp=tp, ep=ep, sequence_parallel=sequence_parallel)
    return build_model(model_cfg, PrecisionConfig(), TRAINER, parallel, device="cpu", seed=0)


# What the spawned ranks run (module-level, so that torch.multiprocessing can pickle them).


def describe_local_models(rank: int, cases: list[tuple[str, ModelConfig]]) -> dict:
    """Each case's model at TP1/EP1: {case: {name: (shape, partition_dim or None)}} from the module's
    own `tensor_model_parallel` / `partition_dim` marks."""
    from skyq.trainer.megatron.mapping import model_tensors

    init_parallel(1, 1)
    described = {}
    for label, model_cfg in cases:
        model = build(model_cfg, tp=1, ep=1)
        described[label] = {
            name: (list(t.shape), t.partition_dim if getattr(t, "tensor_model_parallel", False) else None)
            for name, t in model_tensors(model).items()
        }
    return described


def load_errors(rank: int, hf_dirs: dict[str, str]) -> dict[str, str]:
    """The errors `load_hf_checkpoint` gives (TP1/EP1): a checkpoint lacking a tensor a model
    parameter needs, and a checkpoint tensor the model has no parameter for; `<case>_changed` names
    the model tensors the refused load wrote anyway (none expected)."""
    from skyq.trainer.megatron.mapping import MappingError, load_hf_checkpoint, model_tensors

    init_parallel(1, 1)
    errors = {}
    cases = {
        "missing": (qwen_cfg(), qwen_cfg()),  # (model built from, load told)
        "unused": (qwen_cfg(tie_word_embeddings=True), qwen_cfg()),
    }
    for label, (built, told) in cases.items():
        model = build(built, tp=1, ep=1)
        before = {n: t.detach().clone() for n, t in model_tensors(model).items()}
        try:
            load_hf_checkpoint(model, hf_dirs[label], told, "local")
            errors[label] = ""
        except MappingError as e:
            errors[label] = str(e)
        changed = [n for n, t in model_tensors(model).items() if not torch.equal(t, before[n])]
        errors[f"{label}_changed"] = ", ".join(changed)
    return errors


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


def load_and_export(rank: int, cases: list[tuple[ModelConfig, int, int, str]]) -> None:
    """Per case (model config, tp, ep, HF dir): load the checkpoint into a fresh
    local-spec model, check every loaded tensor against `shard` of `hf_to_megatron` (the pure path),
    then check that `export_hf` gives back exactly the checkpoint, in layer order, on every rank.

    Every layout of one checkpoint must also give the logits of its first layout: that checks the
    slicing against what megatron-core's parallel layers compute (QKV groups, SwiGLU halves,
    row/column dims, MLA heads, experts)."""
    from megatron.core import parallel_state as ps
    from safetensors.torch import load_file

    from skyq.trainer.megatron.mapping import (
        MappingError,
        export_hf,
        global_name,
        hf_to_megatron,
        load_hf_checkpoint,
        model_tensors,
        shard,
    )

    reference: dict[str, torch.Tensor] = {}
    for model_cfg, tp, ep, hf_dir in cases:
        init_parallel(tp, ep)
        original: dict[str, torch.Tensor] = {}
        for file in sorted(Path(hf_dir).glob("*.safetensors")):
            original.update(load_file(str(file)))
        model = build(model_cfg, tp=tp, ep=ep)
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

        logits = _logits(model, model_cfg, tp)
        first = reference.setdefault(hf_dir, logits)
        assert torch.allclose(logits, first, rtol=1e-4, atol=1e-4), (
            f"rank {rank} tp{tp} ep{ep}: logits differ from the first layout's by "
            f"{(logits - first).abs().max():.3g}"
        )

        try:  # the local model's names are not the TE spec's: refused before any collective
            next(export_hf(model, model_cfg, "te"))
            raise AssertionError("export_hf took a local-spec model as spec='te'")
        except MappingError as e:
            assert "spec='te' table does not have" in str(e), e

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
        layout_order = list(hf_text_specs(model_cfg))
        if ep == 1:
            assert names == layout_order, f"rank {rank} tp{tp}: export order is not the layout's"
        else:  # local expert index i of every EP rank, then i + 1: experts 0, 2, 1, 3 at ep=2, E=4
            layer_order = [int(n.split("layers.")[1].split(".")[0]) for n in names if ".layers." in n]
            assert layer_order == sorted(layer_order), f"rank {rank}: export not grouped by layer"
            experts = [n.split("experts.")[1].split(".")[0] for n in names if ".mlp.experts." in n]
            assert experts[:9:3] == ["0", "2", "1"], experts[:9]


def world_size_one(rank: int, cases: list[tuple[str, ModelConfig]], hf_dirs: dict[str, str]) -> dict:
    """`describe_local_models` and `load_errors` in one spawned process (megatron imports once)."""
    return {"described": describe_local_models(rank, cases), "errors": load_errors(rank, hf_dirs)}


def world_size_two(rank: int, cases: list[tuple[ModelConfig, int, int, str]]) -> None:
    """`load_and_export` over `cases` (pipeline parallel layouts: tests/megatron/test_pp.py)."""
    load_and_export(rank, cases)


def cpu_trainer(
    model_cfg: ModelConfig,
    hf_dir: str,
    parallel: ParallelConfig,
    *,
    rank: int,
    world_size: int,
    store,
    micro_batch_size: int,
):
    """A CPU `MegatronTrainer` (fp32, bf16 precision, lr 1e-4) of this rank at `parallel`, from the HF
    checkpoint in `hf_dir`; `store` is the world's rendezvous store."""
    import dataclasses

    from skyq.config.schema import AlgorithmConfig
    from skyq.trainer.megatron.trainer import MegatronTrainer

    return MegatronTrainer(
        model_cfg=model_cfg, precision_cfg=PrecisionConfig(),
        trainer_cfg=dataclasses.replace(TRAINER, micro_batch_size=micro_batch_size),
        algorithm_cfg=AlgorithmConfig(lr=1e-4), parallel_cfg=parallel, checkpoint_path=hf_dir, load_path=None,
        ref_load=None, device="cpu", seed=0, temperature=1.0, rank=rank, world_size=world_size, store=store,
        timeout_s=120.0,
    )  # fmt: skip


def resumes_bit_for_bit(trainer, batch, directory: str, rank: int) -> bool:
    """Save `trainer` (after its first update) into `directory` (rank 0 creates it), update, load the
    checkpoint back and update again: whether the two updates agree bit for bit (log-probs, grad norm).
    A collective of the trainer's world."""
    import torch.distributed as dist

    if rank == 0:
        Path(directory).mkdir()
    dist.barrier()
    trainer.save_checkpoint(directory)
    ahead = trainer.train_step(batch)
    assert trainer.load_checkpoint(directory) == 1
    again = trainer.train_step(batch)
    return bool(torch.equal(ahead["logp"], again["logp"])) and ahead["grad_norm"] == again["grad_norm"]
