"""The one-process placement (`LocalPair`): trainer and engine in the driver process, weights through
the in-process channel. On the GPU box this is `topology=1gpu`; here it runs on the CPU with
`rollout.weight_sync.transport=in_process`, the same code path minus the device."""

from __future__ import annotations

import os
import sys
import threading
import time

import pytest
import torch

from skyq.config.enums import TransportKind
from skyq.launch.checkpointing import latest_checkpoint
from skyq.launch.local_pair import LocalPair, merged_worker_env
from skyq.launch.metrics import read_metrics
from skyq.launch.pair import PairSpec
from skyq.launch.placement import placement_for, resolve_transport
from skyq.launch.rundir import METRICS_FILE
from skyq.rl.tokenizer import EOS_ID
from skyq.sync.errors import SyncError

from .run_helpers import compose_config, run

IN_PROCESS = "rollout.weight_sync.transport=in_process"


@pytest.mark.parametrize(
    ("topology", "transport", "want", "sync_device", "gpus"),
    [
        ("cpu", "auto", TransportKind.broadcast, "cpu", (0, 0)),
        ("cpu", "in_process", TransportKind.in_process, "cpu", (0, 0)),
        ("1gpu", "auto", TransportKind.in_process, "cuda", (1, 1)),
        # Ray actors sharing the GPU (the plan's colocated fractions): frames through host memory
        ("1gpu", "broadcast", TransportKind.broadcast, "cpu", (0.4, 0.2)),
        ("2gpu", "auto", TransportKind.broadcast, "cuda", (1, 1)),
        ("8gpu", "auto", TransportKind.broadcast, "cpu", (0.4, 0.2)),  # colocated
        ("8gpu topology.placement=split topology.trainer_gpus=4 topology.rollout_gpus=4", "auto",
         TransportKind.broadcast, "cuda", (1, 1)),
    ],
)  # fmt: skip
def test_auto_transport_follows_the_placement(topology, transport, want, sync_device, gpus):
    cfg, _ = compose_config([f"topology={topology}".split()[0], *topology.split()[1:],
                             f"rollout.weight_sync.transport={transport}"])  # fmt: skip
    assert cfg.rollout.weight_sync.transport is TransportKind(transport)
    placement = placement_for(cfg.topology, cfg.rollout.weight_sync.transport)
    assert placement.transport is want
    assert placement.sync_device == sync_device
    assert (placement.trainer_gpus, placement.engine_gpus) == gpus


@pytest.mark.parametrize(
    ("topology", "transport", "needle"),
    [
        ("8gpu", "in_process", "has 8 GPUs"),
        ("2gpu", "in_process", "has 2 GPUs"),
        ("cpu", "cuda_ipc", "transport=cuda_ipc"),
    ],
)
def test_a_transport_that_cannot_work_is_refused_naming_the_key(topology, transport, needle):
    cfg, _ = compose_config([f"topology={topology}", f"rollout.weight_sync.transport={transport}"])
    with pytest.raises(ValueError, match="rollout.weight_sync.transport") as info:
        resolve_transport(cfg.topology, cfg.rollout.weight_sync.transport)
    assert needle in str(info.value)


def test_conflicting_worker_env_in_one_process_is_refused_without_printing_a_secret():
    assert merged_worker_env({"A": "1"}, {"A": "1", "B": "2"}) == {"A": "1", "B": "2"}
    with pytest.raises(ValueError, match=r"^trainer.env.A but rollout.env.A differ: ") as failure:
        merged_worker_env({"A": "sk-one"}, {"A": "sk-two"})
    assert "sk-one" not in str(failure.value) and "sk-two" not in str(failure.value)
    with pytest.raises(ValueError, match=r"trainer.env.NCCL_DEBUG='INFO' but rollout.env.NCCL_DEBUG='WARN'"):
        merged_worker_env({"NCCL_DEBUG": "INFO"}, {"NCCL_DEBUG": "WARN"})  # allow-listed: shown


def test_in_process_run_learns_checkpoints_and_resumes_without_ray(tmp_path, base_overrides):
    """A real run through LocalPair: rewards logged, the first sync verified bit for bit, checkpoints,
    and a resume continuing at the saved step. Ray is never started (the device box has no Ray)."""
    ray_before = "ray" in sys.modules and sys.modules["ray"].is_initialized()
    overrides = [*base_overrides, IN_PROCESS, "algorithm.num_steps=4", "checkpoint.save_interval=2"]
    first = run(overrides, tmp_path / "run")
    assert (first.start_step, first.num_steps, first.weight_version) == (0, 4, 4)
    rows = read_metrics(tmp_path / "run" / METRICS_FILE)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert all(r["sync/bytes"] > 0 and 0 <= r["reward"] <= 1 for r in rows)
    # one sender/receiver per channel: only the first sync carries the full manifest
    assert [r["sync/full_manifest"] for r in rows] == [1.0, 0.0, 0.0, 0.0]
    ckpt, state = latest_checkpoint(tmp_path / "run" / "checkpoints")
    assert state.next_step == 4
    resumed = run([*overrides[:-2], "algorithm.num_steps=6", "checkpoint.save_interval=2"],
                  tmp_path / "run", resume=True)  # fmt: skip
    assert (resumed.start_step, resumed.weight_version) == (4, 6)
    assert [r["step"] for r in read_metrics(tmp_path / "run" / METRICS_FILE)] == list(range(6))
    ray_after = "ray" in sys.modules and sys.modules["ray"].is_initialized()
    assert ray_after == ray_before


def _pair(overrides):
    from skyq.trainer.native.tiny_checkpoint import ensure_tiny_checkpoint

    cfg, _ = compose_config(overrides)
    return LocalPair(
        PairSpec(
            model=cfg.model,
            precision=cfg.precision,
            algorithm=cfg.algorithm,
            trainer=cfg.trainer,
            rollout=cfg.rollout,
            placement=placement_for(cfg.topology, cfg.rollout.weight_sync.transport),
            checkpoint_path=str(
                ensure_tiny_checkpoint(cfg.model, cfg.task, cache_dir=cfg.checkpoint.cache_dir)
            ),
            seed=cfg.seed,
            eos_token_id=EOS_ID,
        )
    )


def test_failed_local_sync_names_both_sides_and_keeps_the_engine(base_overrides, monkeypatch):
    """A NaN in the trainer's weights stops the sync at the sender; the trainer tells the engine thread,
    which gives up at once (not at its deadline) and keeps serving the last good version."""
    monkeypatch.delenv("SKYQ_TEST_ENV", raising=False)
    pair = _pair([*base_overrides, IN_PROCESS, "rollout.weight_sync.timeout_s=600",
                  "+trainer.env.SKYQ_TEST_ENV=on"])  # fmt: skip
    try:
        assert os.environ["SKYQ_TEST_ENV"] == "on"
        pair.sync(1)
        pair.verify_engine_matches_trainer()
        name, param = next((n, p) for n, p in pair.trainer.trainer.model.named_parameters() if p.dim() == 2)
        with torch.no_grad():
            param[0, 0] = float("nan")
        started = time.monotonic()
        with pytest.raises(SyncError, match=r"version 2 failed\. trainer: .*engine: ") as info:
            pair.sync(2)
        assert time.monotonic() - started < 60  # far inside the 600 s deadline
        assert "the sender gave up" in str(info.value)
        assert pair.engine.weight_version() == 1
    finally:
        pair.shutdown()
    assert "SKYQ_TEST_ENV" not in os.environ


def test_a_hung_in_process_call_stops_the_run_at_its_deadline(base_overrides, monkeypatch):
    """In one process a hung generate cannot be interrupted, but the driver stops waiting at
    rollout.weight_sync.worker_call_timeout_s and names the worker, the call and the key."""
    from skyq.launch.deadlines import WorkerTimeout

    pair = _pair([*base_overrides, IN_PROCESS, "rollout.weight_sync.worker_call_timeout_s=1"])
    release = threading.Event()
    try:
        pair.sync(1)
        monkeypatch.setattr(pair.engine, "generate", lambda *a, **k: release.wait(60))
        started = time.monotonic()
        with pytest.raises(
            WorkerTimeout,
            match=r"engine \(in this process\): generate did not return within 1 s \(rollout.weight_sync.worker_call_timeout_s\)",
        ):
            pair.generate([[1, 2, 3]], n=1, max_new_tokens=2, temperature=1.0, top_p=1.0, seed=0)
        assert time.monotonic() - started < 30
    finally:
        release.set()
        pair.shutdown()


def test_trainer_fp8_gemm_reaches_the_trainer(base_overrides):
    """`trainer.fp8_gemm` travels config -> PairSpec -> TrainerWorker -> NativeTrainer."""
    from skyq.trainer.native.precision import Fp8GemmExperts, Fp8GemmLinear

    pair = _pair([*base_overrides, IN_PROCESS, "trainer.fp8_gemm=emulated"])
    try:
        trainer = pair.trainer.trainer
        assert trainer.fp8_gemm is True
        assert any(isinstance(m, Fp8GemmLinear | Fp8GemmExperts) for m in trainer.model.modules())
    finally:
        pair.shutdown()


def _score_both_sides(pair, cfg):
    """(trainer log-probs, engine teacher-forced log-probs, response mask) of sequences the engine sampled."""
    from skyq.rl.batch import collate
    from skyq.rl.tasks import build_task

    pair.sync(1)
    task = build_task(cfg.task, seed=cfg.seed)
    prompts = [p.token_ids for p in task.prompts(0, 6)]
    samples = pair.generate(prompts, n=2, max_new_tokens=cfg.task.max_response_length,
                            temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p, seed=0)  # fmt: skip
    seqs = collate(samples, [0.0] * len(samples), group_size=2, normalize_std=False,
                   pad_token_id=task.tokenizer.eos_token_id)  # fmt: skip
    trainer = pair.trainer.trainer.logprobs(seqs.input_ids, seqs.attention_mask)
    engine = pair.engine.score(seqs.input_ids, seqs.attention_mask, cfg.rollout.temperature)
    return trainer, engine, seqs.response_mask.bool()


@pytest.mark.parametrize("precision", ["bf16", "fp8_blockwise", "mxfp8", "int4_qat"])
def test_bf16_trainer_scores_exactly_what_the_engine_computes(base_overrides, precision):
    """trainer.compute_dtype=bf16 (the default): with bit-identical weights on both sides, the trainer's
    log-probs of sampled sequences equal the engine's teacher-forced ones bit for bit on the CPU (the
    same function in the same dtype); an fp32 trainer differs (activation rounding flips)."""
    results = {}
    for dtype in ("bf16", "fp32"):
        overrides = [*base_overrides, IN_PROCESS, f"precision={precision}", "precision.emulate=true",
                     f"trainer.compute_dtype={dtype}"]  # fmt: skip
        cfg, _ = compose_config(overrides)
        pair = _pair(overrides)
        try:
            assert pair.trainer.trainer.compute_dtype == getattr(
                torch, {"bf16": "bfloat16", "fp32": "float32"}[dtype]
            )
            results[dtype] = _score_both_sides(pair, cfg)
        finally:
            pair.shutdown()
    trainer, engine, mask = results["bf16"]
    assert mask.sum() > 0
    assert torch.equal(trainer[mask], engine[mask])
    trainer32, engine32, mask32 = results["fp32"]
    assert (trainer32[mask32] - engine32[mask32]).abs().max() > 0


def test_bf16_trainer_updates_fp32_master_weights(base_overrides):
    """A bf16-compute train step: gradients reach the fp32 master through the cast; it moves and stays fp32."""
    overrides = [*base_overrides, IN_PROCESS, "precision=fp8_blockwise", "trainer.compute_dtype=bf16"]
    cfg, _ = compose_config(overrides)
    pair = _pair(overrides)
    try:
        trainer = pair.trainer.trainer
        before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        from skyq.rl.batch import collate
        from skyq.rl.tasks import build_task

        pair.sync(1)
        task = build_task(cfg.task, seed=cfg.seed)
        samples = pair.generate([p.token_ids for p in task.prompts(0, 4)], n=4,
                                max_new_tokens=cfg.task.max_response_length, temperature=1.0, top_p=1.0, seed=0)  # fmt: skip
        rewards = [float(i % 2) for i in range(len(samples))]
        batch = collate(
            samples, rewards, group_size=4, normalize_std=False, pad_token_id=task.tokenizer.eos_token_id
        )
        metrics = trainer.train_step(batch)
        assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values() if isinstance(v, float))
        after = dict(trainer.model.named_parameters())
        assert all(p.dtype == torch.float32 for p in after.values())
        assert any(not torch.equal(before[n], p.detach()) for n, p in after.items())
    finally:
        pair.shutdown()


def _engine_kwargs(overrides: list[str]) -> dict:
    """`PairSpec.engine_kwargs` of the config these overrides compose."""
    cfg, _ = compose_config(overrides)
    spec = PairSpec(model=cfg.model, precision=cfg.precision, algorithm=cfg.algorithm, trainer=cfg.trainer,
                    rollout=cfg.rollout, placement=placement_for(cfg.topology, cfg.rollout.weight_sync.transport),
                    checkpoint_path="unused", seed=cfg.seed, eos_token_id=EOS_ID)  # fmt: skip
    return spec.engine_kwargs()


@pytest.mark.parametrize(("override", "expected"), [([], True), (["rollout.cuda_graphs=false"], False)])
def test_rollout_cuda_graphs_reaches_the_engine_worker(base_overrides, override, expected):
    """`rollout.cuda_graphs` is an engine argument of both pair kinds (on CPU the engine decodes with
    the growing cache either way)."""
    from skyq.launch.actors import EngineWorker

    kwargs = _engine_kwargs([*base_overrides, IN_PROCESS, *override])
    assert kwargs["cuda_graphs"] is expected
    worker = EngineWorker(**kwargs)
    assert worker.engine.decode_mode == "dynamic"
    assert (
        worker.engine.eos_token_id == kwargs["eos_token_id"] == EOS_ID
    )  # the task tokenizer's, via PairSpec


@pytest.mark.parametrize(("override", "expected"), [([], True), (["rollout.fp8_codes_decode=false"], False)])
def test_rollout_fp8_codes_decode_reaches_every_engine_linear(base_overrides, override, expected):
    """`rollout.fp8_codes_decode` is an engine argument; the engine sets it on each of its quantized
    linears (`WireLinear.codes_decode`, which `quantized_linear.w8a8_quantizer` reads)."""
    from skyq.launch.actors import EngineWorker
    from skyq.rollout.quantized_linear import WireLinear

    kwargs = _engine_kwargs([*base_overrides, IN_PROCESS, *override])
    assert kwargs["fp8_codes_decode"] is expected
    linears = [m for m in EngineWorker(**kwargs).engine.model.modules() if isinstance(m, WireLinear)]
    assert linears and all(m.codes_decode is expected for m in linears)
