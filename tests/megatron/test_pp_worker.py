"""trainer=megatron at PP2 through the real worker (rank 0 a Ray actor, rank 1 the peer actor it
starts), tiny MLA model: what the run loop gets from rank 0, the first pipeline stage (log-probs,
the step's metrics, the serialized wire digest of the export), equals a world size 1 worker's from
the same checkpoint, within tests/megatron/test_worker.py's two-rank tolerances."""

from __future__ import annotations

import dataclasses
import warnings

import pytest

pytest.importorskip("megatron.core")
ray = pytest.importorskip("ray")

from mapping_helpers import TRAINER, deepseek_cfg, write_checkpoint  # noqa: E402
from test_pp import LOGP_TOL, STEP_LOGP_TOL, make_batch, small_hf  # noqa: E402

from skyq.config.schema import AlgorithmConfig, ParallelConfig, PrecisionConfig  # noqa: E402
from skyq.launch.ray_local import local_ray  # noqa: E402
from skyq.trainer.megatron.worker import MegatronTrainerWorker  # noqa: E402


@pytest.fixture(scope="module")
def cluster():
    warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine).*")
    with local_ray(num_cpus=2):
        yield


def _run(model_cfg, hf_dir: str, parallel: ParallelConfig) -> dict:
    kwargs = dict(
        model_cfg=model_cfg, precision_cfg=PrecisionConfig(),
        trainer_cfg=dataclasses.replace(TRAINER, micro_batch_size=2), algorithm_cfg=AlgorithmConfig(lr=1e-4),
        parallel_cfg=parallel, checkpoint_path=hf_dir, device="cpu", seed=0, temperature=1.0, timeout_s=300.0,
    )  # fmt: skip
    worker = ray.remote(MegatronTrainerWorker).options(num_cpus=0, max_restarts=0).remote(**kwargs)
    batch = make_batch(model_cfg.vocab_size)
    try:
        digest = ray.get(worker.serialized_digest.remote())
        before = ray.get(worker.logprobs.remote(batch.input_ids, batch.attention_mask))
        metrics = ray.get(worker.train_step.remote(batch))
        after = ray.get(worker.logprobs.remote(batch.input_ids, batch.attention_mask))
    finally:
        ray.get(worker.close.remote())
        ray.kill(worker)
    return {"digest": digest, "before": before, "metrics": metrics, "after": after}


def test_rank_0_of_a_pp2_worker_returns_what_world_size_one_does(cluster, tmp_path):
    model_cfg = deepseek_cfg()
    hf_dir = str(write_checkpoint(tmp_path / "mla", small_hf(model_cfg, seed=40)))
    one = _run(model_cfg, hf_dir, ParallelConfig())
    two = _run(model_cfg, hf_dir, ParallelConfig(pp=2))
    assert two["digest"] == one["digest"]  # the export crosses the pipeline into the same wire
    mask = make_batch(model_cfg.vocab_size).attention_mask.float()
    assert float(((two["before"] - one["before"]).abs() * mask).max()) < LOGP_TOL
    for key in ("loss", "pg_loss", "mismatch_mean_abs"):
        assert two["metrics"][key] == pytest.approx(one["metrics"][key], rel=1e-5, abs=1e-6), key
    assert two["metrics"]["grad_norm"] == pytest.approx(one["metrics"]["grad_norm"], rel=1e-5)
    assert float(((two["after"] - one["after"]).abs() * mask).max()) < STEP_LOGP_TOL
    assert float(((one["after"] - one["before"]).abs() * mask).max()) > 20 * STEP_LOGP_TOL
