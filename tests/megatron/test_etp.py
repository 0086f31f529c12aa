"""Routed experts replicated across the TP ranks (TP2 + sequence parallel, ETP1, EP1) in trainer=megatron
on the CPU (gloo, world size 2), tiny Qwen3-MoE: one spawned run of two ranks.

Each TP rank holds whole experts and routes its half of the sequence to them, so its expert gradients
are partial and must be summed over the expert-data-parallel group (the two TP ranks).
megatron-core 0.16.1 marks them for that group (`allreduce=False`) only at ep > 1;
`skyq.trainer.megatron.model.mark_experts_expert_data_parallel` marks them at ep = 1 too. Checked here:
the marks (experts only, not the router), the two replicas of every expert still equal after an update
(unreduced, each rank stepped its replica with its own partial gradient), and a save -> load that
restores the next update bit for bit (the experts get their own distributed-optimizer part in this
layout). tests/megatron/test_worker.py compares the layout's log-probs and grad norm with world size 1.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed (dev extra, Python < 3.12)")

from dist_helpers import run_ranks  # noqa: E402  (tests/megatron is on sys.path)
from mapping_helpers import qwen_cfg, resumes_bit_for_bit, write_checkpoint  # noqa: E402
from test_pp import _free_ports, _trainer, make_batch, small_hf  # noqa: E402

from skyq.config.schema import ModelConfig, ParallelConfig  # noqa: E402

TP2_ETP1 = ParallelConfig(tp=2, sequence_parallel=True, etp=1, ep=1, dp=1)


def etp1_run(rank: int, model_cfg: ModelConfig, hf_dir: str, port: int, ckpt: str) -> dict:
    """At TP2 SP ETP1: the parameters marked for the expert-data-parallel group, the experts after one
    update, and whether save -> step -> load -> step repeats the step."""
    import torch.distributed as dist

    dist.destroy_process_group()  # the trainer joins its own world
    batch = make_batch(model_cfg.vocab_size)
    trainer = _trainer(model_cfg, hf_dir, TP2_ETP1, rank=rank, world_size=2, port=port)
    module = trainer.model.module
    expert_marked = sorted(n for n, p in module.named_parameters() if not getattr(p, "allreduce", True))
    trainer.train_step(batch)
    experts = {n: p.detach().clone() for n, p in module.named_parameters() if ".mlp.experts." in n}
    resumed_equal = resumes_bit_for_bit(trainer, batch, ckpt, rank)
    names = [n for n, _ in module.named_parameters()]
    trainer.close()
    if not dist.is_initialized():  # dist_helpers' teardown destroys the default group
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return {"marked": expert_marked, "names": names, "experts": experts, "resumed_equal": resumed_equal}


def test_tp2_etp1_reduces_the_experts_over_the_tp_ranks_and_resumes_bit_for_bit(tmp_path):
    cfg = qwen_cfg()
    hf_dir = str(write_checkpoint(tmp_path / "hf", small_hf(cfg, seed=40)))
    ranks = run_ranks(etp1_run, 2, cfg, hf_dir, _free_ports(1)[0], str(tmp_path / "ckpt"))
    for rank, out in enumerate(ranks):
        experts = [n for n in out["names"] if ".mlp.experts." in n]
        assert len(experts) == 2 * cfg.num_layers * cfg.num_experts  # fc1, fc2 per expert per layer
        assert out["marked"] == sorted(experts), f"rank {rank}"  # the router and the norms are not
        assert out["resumed_equal"], f"rank {rank}: the update after load differs"
    for name, tensor in ranks[0]["experts"].items():
        assert torch.equal(tensor, ranks[1]["experts"][name]), f"{name}: the TP ranks' replicas differ"
