"""trainer=megatron's optimizer settings on a GPU: `trainer.optimizer.cpu_offload`, `overlap_cpu_offload`
and `precision_aware`, through the real `MegatronTrainer` (TE spec, megatron-core's distributed
optimizer, world size 1 on NCCL).

Needs CUDA, megatron-core and Transformer Engine (on the lent H200: staged, docs/gpu_box.md); skipped
elsewhere (on the CPU the trainer refuses cpu_offload and precision_aware: tests/megatron/test_worker.py).

One spawned process runs the four settings one after another from the same HF checkpoint and batch
(three GRPO updates each) and reports, per setting: the log-probs after the updates, the grad norms,
where the optimizer's state tensors live (device and dtype, bytes), the GPU memory the trainer holds
after two updates, and the step time. The settings are compared on the optimizer's own fp32 master weights and moments (as megatron-core
reads them for a checkpoint) after the first update, whose gradient is the same in every setting,
not on log-probs: a one-ulp difference in a bf16 weight flips top-k expert choices, which moves this
random MoE's log-probs by ~1 nat (measured), so later gradients differ by routing, not optimizer.
Asserted:
- precision_aware: the moments are bf16 (TE's FusedAdam keeps the fp32 master copy instead of
  megatron-core, as bf16 weight + int16 remainder), at least 3 bytes per parameter less on the GPU,
  and the moments within 3% of the fp32-moment optimizer's;
- cpu_offload (with precision_aware, which megatron-core's offloaded optimizer needs): no optimizer
  state on the GPU, at least 11 of the 12 bytes per parameter of the fp32 master copy and the two
  fp32 moments less on the GPU, and the master weights and moments within 1e-3 of the GPU optimizer's
  (torch's AdamW on the CPU against TE's FusedAdam);
- overlap_cpu_offload: the same updates as cpu_offload without overlap, to float rounding (the same
  CPU AdamW, one optimizer per parameter, its copies on side streams).
Every setting also saves a dist checkpoint after its second update, updates, loads it and updates
again: the master weights, the moments and the log-probs after the two third updates must be equal.
The run's numbers go to $SKYQ_GPU_REPORT (a JSON file) when it is set.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import traceback
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("transformer_engine.pytorch")
pytest.importorskip("megatron.core")

SHAPE = [
    "model=tiny_moe", "model.hidden_size=512", "model.moe_intermediate_size=512", "model.num_layers=2",
    "model.vocab_size=1024", "model.head_dim=64", "model.num_attention_heads=8", "model.num_key_value_heads=4",
    "model.num_experts=8", "model.num_experts_per_tok=2", "topology=1gpu", "trainer=megatron",
    "precision=bf16", "algorithm.lr=1e-4", "trainer.micro_batch_size=4",
]  # fmt: skip
SETTINGS = {
    "gpu": [],
    "precision_aware": ["trainer.optimizer.precision_aware=true"],
    # megatron-core's offloaded optimizer reuses the precision-aware path (validate refuses it alone)
    "cpu_offload": ["trainer.optimizer.cpu_offload=true", "trainer.optimizer.precision_aware=true"],
    "cpu_offload_overlap": [
        "trainer.optimizer.cpu_offload=true", "trainer.optimizer.precision_aware=true",
        "trainer.optimizer.overlap_cpu_offload=true",
    ],
}  # fmt: skip
STEPS = 3


def _batch(vocab: int):
    from skyq.rl.batch import RolloutBatch

    g = torch.Generator().manual_seed(3)
    rows, cols = 8, 48
    lengths = torch.randint(24, cols + 1, (rows,), generator=g)
    attn = (torch.arange(cols)[None] < lengths[:, None]).long()
    response = attn.float()
    response[:, :8] = 0
    return RolloutBatch(
        input_ids=torch.randint(0, vocab, (rows, cols), generator=g), attention_mask=attn,
        response_mask=response, rollout_logprobs=-torch.rand(rows, cols, generator=g) * 3 * response,
        advantages=torch.randn(rows, generator=g), rewards=torch.rand(rows, generator=g),
    )  # fmt: skip


def _state_bytes(optimizer) -> dict[str, int]:
    """Bytes of the optimizer's state tensors (moments, master copies) by 'device/dtype'."""
    out: dict[str, int] = {}
    for chained in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = chained.optimizer
        for state in inner.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor) and value.numel() > 1:
                    key = f"{value.device.type}/{str(value.dtype).removeprefix('torch.')}"
                    out[key] = out.get(key, 0) + value.numel() * value.element_size()
    return out


def _master_state(trainer) -> dict[str, dict[str, torch.Tensor]]:
    """{parameter name: {"param": fp32 master copy, "exp_avg", "exp_avg_sq"}} as the distributed
    optimizer itself reads them for a checkpoint (`_get_main_param_and_optimizer_states`: megatron-core's
    main params, TE FusedAdam's unscaled state or the HybridDeviceOptimizer's host copies), flat, fp32,
    on the CPU. World size 1: every shard is the whole parameter."""
    names = {p: n for n, p in trainer.model.module.named_parameters()}
    out = {}
    for chained in getattr(trainer.optimizer, "chained_optimizers", [trainer.optimizer]):
        for model_param in chained.model_param_group_index_map:
            tensors = chained._get_main_param_and_optimizer_states(model_param)
            out[names[model_param]] = {
                k: tensors[k].detach().float().flatten().cpu().clone()
                for k in ("param", "exp_avg", "exp_avg_sq")
            }
    return out


def _offloaded_steps(trainer) -> list[float]:
    """The distinct Adam step counts of the host-side (offloaded) parameters; [] without offload."""
    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

    steps = set()
    for chained in getattr(trainer.optimizer, "chained_optimizers", [trainer.optimizer]):
        if isinstance(chained.optimizer, HybridDeviceOptimizer):
            for sub in chained.optimizer.sub_optimizers:
                steps.update(float(s["step"]) for s in sub.state.values() if "step" in s)
    return sorted(steps)


def _run(out_file: str, hf_dir: str) -> None:
    try:
        import gc
        import time

        from skyq.config.store import compose, to_object
        from skyq.trainer.megatron.group import open_world_store
        from skyq.trainer.megatron.trainer import MegatronTrainer
        from skyq.trainer.megatron.worker import world_layout

        results = {}
        for name, overrides in SETTINGS.items():
            cfg = to_object(compose([*SHAPE, *overrides]))
            batch = _batch(cfg.model.vocab_size)
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            trainer = MegatronTrainer(
                model_cfg=cfg.model, precision_cfg=cfg.precision, trainer_cfg=cfg.trainer,
                algorithm_cfg=cfg.algorithm, parallel_cfg=world_layout(cfg.topology.parallel, device="cuda", trainer_gpus=1), checkpoint_path=hf_dir,
                load_path=None, ref_load=None, device="cuda:0", seed=0, temperature=1.0, rank=0, world_size=1,
                store=open_world_store(1, 120.0), timeout_s=120.0,
            )  # fmt: skip
            before = trainer.logprobs(batch.input_ids, batch.attention_mask)["logp"].cpu()
            initial = {
                n: p.detach().float().flatten().cpu().clone()
                for n, p in trainer.model.module.named_parameters()
            }
            norms, times = [], []
            for step in range(STEPS):
                if step == STEPS - 1:
                    torch.cuda.synchronize()
                    held = torch.cuda.memory_allocated() - base  # after two updates: the state exists
                    directory = Path(out_file).parent / f"ckpt_{name}"
                    directory.mkdir()
                    saved_state = _master_state(trainer)
                    trainer.save_checkpoint(str(directory))
                    trainer.train_step(batch)
                    ahead = trainer.logprobs(batch.input_ids, batch.attention_mask)["logp"].cpu()
                    ahead_state = _master_state(trainer)
                    assert trainer.load_checkpoint(str(directory)) == STEPS - 1
                    loaded_state = _master_state(trainer)
                    steps_after_load = _offloaded_steps(trainer)
                torch.cuda.synchronize()
                start = time.perf_counter()
                last = trainer.train_step(batch)
                norms.append(last["grad_norm"])
                if step == 0:
                    first = _master_state(trainer)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
            after = trainer.logprobs(batch.input_ids, batch.attention_mask)["logp"].cpu()
            torch.cuda.synchronize()
            params = sum(p.numel() for p in trainer.model.module.parameters())
            results[name] = {
                "before": before, "after": after, "grad_norms": norms, "step_s": times,
                "state_bytes": _state_bytes(trainer.optimizer), "gpu_bytes": held,
                "params": params, "optimizer": type(trainer.optimizer).__name__,
                "resume_diff": float((after - ahead).abs().max()), "steps_after_load": steps_after_load,
                "initial": initial, "first": first, "state": (state := _master_state(trainer)),
                "load_state_diff": {
                    k: max(float((loaded_state[n][k] - saved_state[n][k]).abs().max()) for n in state)
                    for k in ("param", "exp_avg", "exp_avg_sq")
                },
                "resume_state_diff": {
                    k: max(float((state[n][k] - ahead_state[n][k]).abs().max()) for n in state)
                    for k in ("param", "exp_avg", "exp_avg_sq")
                },
            }  # fmt: skip
            trainer.close()
            del trainer
            gc.collect()
            torch.cuda.empty_cache()
        torch.save(results, out_file)
    except BaseException:
        Path(out_file + ".err").write_text(traceback.format_exc())
        raise


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from safetensors.torch import save_file

    from skyq.config.store import compose, to_object
    from skyq.trainer.megatron.mapping.tables import hf_text_specs

    tmp = tmp_path_factory.mktemp("optimizer")
    model_cfg = to_object(compose(SHAPE)).model
    gen = torch.Generator().manual_seed(0)
    tensors = {
        name: (
            torch.ones(spec.shape) if "norm" in name else torch.randn(spec.shape, generator=gen) * 0.05
        ).to(spec.dtype)
        for name, spec in hf_text_specs(model_cfg).items()
    }
    hf_dir = tmp / "hf"
    hf_dir.mkdir()
    save_file(tensors, str(hf_dir / "model.safetensors"), metadata={"format": "pt"})
    (hf_dir / "config.json").write_text(json.dumps({"model_type": "qwen3_moe"}))
    out = str(tmp / "results.pt")
    process = mp.get_context("spawn").Process(target=_run, args=(out, str(hf_dir)))
    process.start()
    process.join(timeout=500)
    if process.is_alive():
        process.kill()
        pytest.fail("the optimizer runs did not finish in 500 s")
    if Path(out + ".err").exists():
        pytest.fail(Path(out + ".err").read_text())
    results = torch.load(out, weights_only=True)
    report = {
        name: {
            "grad_norms": r["grad_norms"], "step_s": r["step_s"], "state_bytes": r["state_bytes"],
            "gpu_bytes": r["gpu_bytes"], "params": r["params"], "optimizer": r["optimizer"],
            "resume_diff": r["resume_diff"], "resume_state_diff": r["resume_state_diff"],
            "load_state_diff": r["load_state_diff"], "steps_after_load": r["steps_after_load"],
            "rel_vs_gpu": _relative(r, results["gpu"]),
            "max_dlogp_vs_gpu": float((r["after"] - results["gpu"]["after"]).abs().max()),
            "max_moved": float((r["after"] - r["before"]).abs().max()),
        }
        for name, r in results.items()
    }  # fmt: skip
    print(json.dumps(report, indent=1))
    if os.environ.get("SKYQ_GPU_REPORT"):
        Path(os.environ["SKYQ_GPU_REPORT"]).write_text(json.dumps(report, indent=1))
    return results, report


def _relative(run: dict, reference: dict) -> dict[str, float]:
    """How far `run`'s optimizer state is from `reference`'s after the first update (the same
    gradient in both: the same weights and batch): the master weights relative to how far the
    reference's moved from the checkpoint, each moment relative to the reference's (norms over
    every parameter)."""

    def norm(pairs) -> float:
        return float(sum(float((a - b).double().pow(2).sum()) for a, b in pairs) ** 0.5)

    names = list(reference["state"])
    out = {
        "param": norm((run["first"][n]["param"], reference["first"][n]["param"]) for n in names)
        / norm((reference["first"][n]["param"], reference["initial"][n]) for n in names)
    }
    for k in ("exp_avg", "exp_avg_sq"):
        zero = torch.zeros(1)
        out[k] = norm((run["first"][n][k], reference["first"][n][k]) for n in names) / norm(
            (reference["first"][n][k], zero) for n in names
        )
    return out


def _on(report: dict, device: str) -> int:
    return sum(b for key, b in report["state_bytes"].items() if key.startswith(device + "/"))


def test_the_gpu_optimizer_keeps_fp32_state_on_the_gpu_and_moves_the_policy(runs):
    results, report = runs
    gpu = report["gpu"]
    assert _on(gpu, "cpu") == 0 and _on(gpu, "cuda") >= 7 * gpu["params"], gpu["state_bytes"]
    assert gpu["max_moved"] > 0.01, gpu  # three updates at lr 1e-4 move the log-probs visibly


def test_cpu_offload_holds_the_state_in_host_memory_and_updates_like_the_gpu_optimizer(runs):
    results, report = runs
    gpu, off = report["gpu"], report["cpu_offload"]
    assert off["optimizer"] == gpu["optimizer"]
    assert _on(off, "cuda") == 0 and _on(off, "cpu") >= 11 * off["params"], off["state_bytes"]
    assert gpu["gpu_bytes"] - off["gpu_bytes"] >= 11 * gpu["params"], (gpu["gpu_bytes"], off["gpu_bytes"])
    # torch's AdamW on the host against TE's FusedAdam, both fp32: the same updates to rounding
    assert max(off["rel_vs_gpu"].values()) < 1e-3, off["rel_vs_gpu"]
    assert off["grad_norms"][0] == pytest.approx(gpu["grad_norms"][0], rel=1e-3)


def test_overlapped_offload_copies_give_the_same_updates(runs):
    results, report = runs
    assert _on(report["cpu_offload_overlap"], "cuda") == 0
    assert max(_relative(results["cpu_offload_overlap"], results["cpu_offload"]).values()) < 1e-6
    assert report["cpu_offload_overlap"]["grad_norms"] == pytest.approx(
        report["cpu_offload"]["grad_norms"], rel=1e-5
    )


def test_precision_aware_keeps_bf16_moments_and_updates_close_to_fp32_moments(runs):
    results, report = runs
    gpu, aware = report["gpu"], report["precision_aware"]
    assert aware["state_bytes"].get("cuda/bfloat16", 0) >= 2 * 2 * aware["params"] * 0.9, aware["state_bytes"]
    assert gpu["gpu_bytes"] - aware["gpu_bytes"] >= 3 * gpu["params"], (gpu["gpu_bytes"], aware["gpu_bytes"])
    # bf16 moments: each within bf16's relative precision of the fp32 ones, the weights close
    # (its "param" is TE's master in store_param_remainders form: the int16 low bits under the bf16
    # weight, not an fp32 value, so only the moments compare here; the round trip checks it too)
    assert max(aware["rel_vs_gpu"]["exp_avg"], aware["rel_vs_gpu"]["exp_avg_sq"]) < 3e-2, aware["rel_vs_gpu"]


@pytest.mark.parametrize("name", list(SETTINGS))
def test_a_checkpoint_round_trip_restores_the_optimizer_state_and_the_next_update(runs, name):
    results, report = runs
    assert report[name]["resume_state_diff"] == {"param": 0.0, "exp_avg": 0.0, "exp_avg_sq": 0.0}, report[
        name
    ]
    assert report[name]["resume_diff"] == 0.0, report[name]
    if name.startswith("cpu_offload"):  # the updates the checkpoint had made (skyq sets them: trainer.py)
        assert report[name]["steps_after_load"] == [float(STEPS - 1)], report[name]["steps_after_load"]
