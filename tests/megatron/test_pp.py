"""Pipeline parallelism in trainer=megatron on the CPU (gloo, world size 2), tiny Qwen3-MoE and tiny
MLA (DeepSeek-V3 family) models.

- HF -> Megatron at PP2 (even, and uneven first / last stage layer counts on a 3-layer model, tied
  embeddings): every stage holds its layers' shards of the pure `hf_to_megatron` tensors, and the
  export gives the checkpoint back bit for bit, whole, in the layout's order, on both ranks.
- `MegatronTrainer` at PP2 (megatron-core's non-interleaved 1F1B schedule, two micro-batches) scores,
  updates and reports the grad norm like world size 1 from the same checkpoint, within the tolerances
  of tests/megatron/test_worker.py's two-rank layouts; a dist-checkpoint save -> load at PP2 restores
  the next update bit for bit.

Each test is one spawned run of two ranks (megatron-core imported once per rank). Version detail:
on megatron-core 0.16.1 (the CPU pin) these run only with `cpu_compat`'s pipeline patches (the
schedules' token counter allocated on "cuda", `torch.cuda.synchronize` after the batched p2p ops,
the tied embedding's `Tensor.cuda()` copy to the last stage); without any one of them they fail.
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed (dev extra, Python < 3.12)")

from dist_helpers import init_parallel, run_ranks  # noqa: E402  (tests/megatron is on sys.path)
from mapping_helpers import (  # noqa: E402
    TRAINER,
    cpu_trainer,
    deepseek_cfg,
    qwen_cfg,
    random_hf,
    resumes_bit_for_bit,
    write_checkpoint,
)

from skyq.config.schema import AlgorithmConfig, ModelConfig, ParallelConfig, PrecisionConfig  # noqa: E402
from skyq.rl.batch import RolloutBatch  # noqa: E402
from skyq.rl.grpo import policy_loss  # noqa: E402

LOGP_TOL = 2e-5
"""As tests/megatron/test_worker.py: max |log-prob| difference on the same fp32 weights."""
STEP_LOGP_TOL = 5e-4
"""As tests/megatron/test_worker.py: max |log-prob| difference after one Adam update at lr 1e-4."""


def _free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def small_hf(model_cfg: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """`random_hf` with weights of a trainable scale: norms 1, the rest N(0, 0.1^2)."""
    return {
        name: (torch.ones_like(t) if "norm" in name else t * 0.1).to(t.dtype)
        for name, t in random_hf(model_cfg, seed).items()
    }


# --- HF <-> Megatron at PP2 -----------------------------------------------------------------------


def pp_load_export(rank: int, cases: list[tuple[str, ModelConfig, int | None, int | None, str]]) -> dict:
    """Per case (label, model, first_stage_layers, last_stage_layers, HF dir), at PP2: load, check
    every stage tensor against the pure conversion, export; {label: (this stage's global layers,
    exported names)}. Asserts the export equals the checkpoint bit for bit."""
    from megatron.core import parallel_state as ps
    from safetensors.torch import load_file

    from skyq.trainer.megatron.mapping import export_hf, hf_to_megatron, load_hf_checkpoint, model_tensors
    from skyq.trainer.megatron.mapping.io import layer_offset
    from skyq.trainer.megatron.model import build_model

    init_parallel(pp=2)
    out = {}
    for label, model_cfg, first, last, hf_dir in cases:
        original: dict[str, torch.Tensor] = {}
        for file in sorted(Path(hf_dir).glob("*.safetensors")):
            original.update(load_file(str(file)))
        parallel = ParallelConfig(pp=2, first_stage_layers=first, last_stage_layers=last)
        model = build_model(model_cfg, PrecisionConfig(), TRAINER, parallel, device="cpu", seed=0)
        load_hf_checkpoint(model, hf_dir, model_cfg, "local")
        full = hf_to_megatron(original, model_cfg, "local")
        tensors = model_tensors(model)
        for name, tensor in tensors.items():
            source = (
                "embedding.word_embeddings.weight"
                if name == "output_layer.weight" and (model_cfg.tie_word_embeddings)
                else name
            )
            assert torch.equal(tensor.detach(), full[source].to(tensor.dtype)), f"{label} rank {rank}: {name}"
        layers = sorted({int(n.split(".")[2]) for n in tensors if n.startswith("decoder.layers.")})
        assert layers[0] == layer_offset(model)
        assert ("embedding.word_embeddings.weight" in tensors) == ps.is_pipeline_first_stage()
        assert ("decoder.final_layernorm.weight" in tensors) == ps.is_pipeline_last_stage()
        exported = list(export_hf(model, model_cfg, "local"))
        for name, tensor in exported:
            assert tensor.dtype == original[name].dtype and torch.equal(tensor, original[name]), (
                f"{label} rank {rank}: {name} differs"
            )
        out[label] = (layers, [n for n, _ in exported])
    return out


CASES = {  # label: (model, first_stage_layers, last_stage_layers, global layers of stage 0, of stage 1)
    "qwen": (qwen_cfg(), None, None, [0], [1]),
    "qwen_tied": (qwen_cfg(tie_word_embeddings=True), None, None, [0], [1]),
    "qwen_3_layers_first_1": (qwen_cfg(num_layers=3), 1, None, [0], [1, 2]),
    "mla": (deepseek_cfg(), None, None, [0], [1]),
    "mla_3_layers_last_1": (deepseek_cfg(num_layers=3), None, 1, [0, 1], [2]),
}


def test_pp2_loads_each_stage_and_exports_the_whole_checkpoint_bit_for_bit(tmp_path):
    from skyq.trainer.megatron.mapping.tables import hf_text_specs

    cases = [
        (label, cfg, first, last, str(write_checkpoint(tmp_path / label, small_hf(cfg, seed=20 + i))))
        for i, (label, (cfg, first, last, _, _)) in enumerate(CASES.items())
    ]
    by_rank = run_ranks(pp_load_export, 2, cases)
    for label, (cfg, _, _, stage0, stage1) in CASES.items():
        assert by_rank[0][label][0] == stage0 and by_rank[1][label][0] == stage1, label
        layout_order = list(hf_text_specs(cfg))
        assert by_rank[0][label][1] == by_rank[1][label][1] == layout_order, label


# --- MegatronTrainer at PP2 vs world size 1 --------------------------------------------------------


def make_batch(vocab: int) -> RolloutBatch:
    """4 right-padded rows of random tokens (lengths 7..10), responses from position 3."""
    g = torch.Generator().manual_seed(7)
    lengths = torch.tensor([10, 7, 9, 10])
    ids = torch.randint(0, vocab, (4, 10), generator=g)
    attn = (torch.arange(10)[None] < lengths[:, None]).long()
    response = attn.float()
    response[:, :3] = 0
    return RolloutBatch(
        input_ids=ids, attention_mask=attn, response_mask=response,
        rollout_logprobs=-torch.rand(4, 10, generator=g) * 3 * response,
        advantages=torch.randn(4, generator=g), rewards=torch.rand(4, generator=g),
    )  # fmt: skip


def _trainer(model_cfg, hf_dir, parallel, *, rank, world_size, port):
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=rank == 0, use_libuv=False)
    return cpu_trainer(
        model_cfg, hf_dir, parallel, rank=rank, world_size=world_size, store=store, micro_batch_size=2
    )


def _steps(trainer, batch: RolloutBatch) -> dict:
    before = trainer.logprobs(batch.input_ids, batch.attention_mask)["logp"]
    step = trainer.train_step(batch)
    after = trainer.logprobs(batch.input_ids, batch.attention_mask)["logp"]
    return {"before": before, "step_logp": step["logp"], "grad_norm": step["grad_norm"], "after": after}


def pp_trainer_runs(
    rank: int, cases: list[tuple[str, ModelConfig, str]], ports: list[int], ckpt: str
) -> dict:
    """Per case: PP2 (both ranks) then world size 1 (rank 0 alone), each from the HF checkpoint.
    At PP2, after the first step: save, step, load, step again (the two second steps must agree)."""
    import torch.distributed as dist

    from skyq.trainer.megatron.mapping import model_tensors

    dist.destroy_process_group()  # each trainer joins its own world
    out: dict = {}
    ports = list(ports)
    for label, model_cfg, hf_dir in cases:
        batch = make_batch(model_cfg.vocab_size)
        trainer = _trainer(
            model_cfg, hf_dir, ParallelConfig(pp=2, dp=1), rank=rank, world_size=2, port=ports.pop()
        )
        pp2 = _steps(trainer, batch)
        pp2["stage_layers"] = sorted(
            {
                int(n.split(".")[2])
                for n in model_tensors(trainer.model.module)
                if n.startswith("decoder.layers.")
            }
        )
        pp2["resumed_equal"] = resumes_bit_for_bit(trainer, batch, f"{ckpt}/{label}", rank)
        trainer.close()
        out[label] = {"pp2": pp2}
    for label, model_cfg, hf_dir in cases:
        port = ports.pop()
        if rank == 0:
            batch = make_batch(model_cfg.vocab_size)
            trainer = _trainer(model_cfg, hf_dir, ParallelConfig(dp=1), rank=0, world_size=1, port=port)
            out[label]["ws1"] = _steps(trainer, batch)
            trainer.close()
    if not dist.is_initialized():  # dist_helpers' teardown destroys the default group
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return out


def _losses(logp: torch.Tensor, batch: RolloutBatch) -> dict[str, float]:
    from skyq.trainer.megatron.trainer import loss_kwargs

    _, metrics = policy_loss(
        logp, logp, batch.rollout_logprobs, batch.advantages, batch.response_mask,
        **loss_kwargs(AlgorithmConfig(lr=1e-4)),
    )  # fmt: skip
    return {k: metrics[k] for k in ("loss", "pg_loss")}


def test_pp2_trains_like_world_size_one_and_resumes_bit_for_bit(tmp_path):
    models = {"qwen_tied": qwen_cfg(tie_word_embeddings=True), "mla": deepseek_cfg()}
    cases = [
        (label, cfg, str(write_checkpoint(tmp_path / label, small_hf(cfg, seed=30 + i))))
        for i, (label, cfg) in enumerate(models.items())
    ]
    (tmp_path / "ckpt").mkdir()
    results = run_ranks(pp_trainer_runs, 2, cases, _free_ports(2 * len(cases)), str(tmp_path / "ckpt"))
    for label, cfg in models.items():
        batch = make_batch(cfg.vocab_size)
        mask = batch.attention_mask.float()
        ws1 = results[0][label]["ws1"]
        for rank in (0, 1):  # the first stage returns the last stage's log-probs too
            pp2 = results[rank][label]["pp2"]
            assert pp2["stage_layers"] == [rank], f"{label} rank {rank}: {pp2['stage_layers']}"
            for key, tol in (("before", LOGP_TOL), ("step_logp", LOGP_TOL), ("after", STEP_LOGP_TOL)):
                diff = float(((pp2[key] - ws1[key]).abs() * mask).max())
                assert diff < tol, f"{label} rank {rank} {key}: {diff:.3g}"
            assert pp2["grad_norm"] == pytest.approx(ws1["grad_norm"], rel=1e-5), label
            mine, theirs = _losses(pp2["step_logp"], batch), _losses(ws1["step_logp"], batch)
            assert mine == pytest.approx(theirs, rel=1e-5, abs=1e-6), label
            assert pp2["resumed_equal"], f"{label} rank {rank}: the update after load differs"
        # the update moved the policy by far more than the tolerance
        assert float(((ws1["after"] - ws1["before"]).abs() * mask).max()) > 20 * STEP_LOGP_TOL, label


# --- config ----------------------------------------------------------------------------------------


def test_validate_takes_a_cpu_pipeline_and_refuses_stage_counts_megatron_refuses():
    from skyq.config.store import compose, to_object
    from skyq.config.validate import ConfigValidationError, validate

    def cfg(*parallel):
        overrides = ["trainer=megatron", "precision=bf16", "model=small_moe", "topology.parallel.pp=2"]
        return to_object(compose(overrides + [f"topology.parallel.{p}" for p in parallel]))

    validate(cfg())
    validate(cfg("first_stage_layers=1"))  # the last stage takes the other 3
    validate(cfg("first_stage_layers=1", "last_stage_layers=3"))  # no middle stage, no layer left
    for bad in (("first_stage_layers=4",), ("first_stage_layers=1", "last_stage_layers=2")):
        with pytest.raises(ConfigValidationError, match="first_stage_layers=.* not an even split"):
            validate(cfg(*bad))
