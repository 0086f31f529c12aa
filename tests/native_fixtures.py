"""Fixtures shared by tests/trainer and tests/rollout: the real composed default config per
precision and one tiny checkpoint per session. Each of those conftests imports them by name.

The checkpoint cache lives in the session's base temp dir, so both directories share it
(whichever runs first builds it; the other finds it by its config hash).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from skyq.config.enums import Precision
from skyq.config.schema import TrainConfig
from skyq.config.store import compose, to_object
from skyq.trainer.native.tiny_checkpoint import ensure_tiny_checkpoint
from skyq.trainer.native.trainer import NativeTrainer

PRECISIONS = ("bf16", "fp8_blockwise", "mxfp8", "int4_qat")
WARMUP_OVERRIDES = ["model.init_sft_steps=100"]


@pytest.fixture(scope="session", autouse=True)
def _one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)  # shared 2-core machines; also makes CPU results reproducible
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def run_cfg():
    """`run_cfg(precision, **algorithm_overrides)`: the composed default config (composed once; the
    precision group options set only `precision.name`, so other precisions are that one field)."""
    base = to_object(compose(WARMUP_OVERRIDES))

    def get(precision: str = "fp8_blockwise", **algorithm: object) -> TrainConfig:
        return dataclasses.replace(
            base,
            precision=dataclasses.replace(base.precision, name=Precision(precision)),
            algorithm=dataclasses.replace(base.algorithm, **algorithm),
        )

    return get


@pytest.fixture(scope="session")
def tiny_checkpoint(run_cfg, tmp_path_factory) -> str:
    cfg = run_cfg()
    return str(
        ensure_tiny_checkpoint(cfg.model, cfg.task, cache_dir=tmp_path_factory.getbasetemp() / "skyq_cache")
    )


@pytest.fixture
def make_trainer(run_cfg, tiny_checkpoint):
    def make(
        precision: str = "fp8_blockwise", *, micro_batch_size: int = 64, **algorithm: object
    ) -> NativeTrainer:
        cfg = run_cfg(precision, **algorithm)
        return NativeTrainer(
            model_cfg=cfg.model, precision_cfg=cfg.precision, optimizer_cfg=cfg.trainer.optimizer,
            algorithm_cfg=cfg.algorithm, micro_batch_size=micro_batch_size, checkpoint_path=tiny_checkpoint, seed=0,
        )  # fmt: skip

    return make


def sync_in_process(
    trainer, engine, version: int, weights=None, *, serialize=None, timeout_s=10.0, prepare=None
):
    """Trainer worker -> engine worker over the in-process transport (the sender on this thread, the
    receiver on another); returns (sender error, receiver error), None where that side succeeded.
    `serialize` replaces the trainer's; `prepare(send_end)` may wrap the sending end first (a test
    corrupting frames)."""
    import threading

    from skyq.sync.errors import SyncError
    from skyq.sync.in_process import in_process_pair
    from skyq.sync.receiver import WeightReceiver
    from skyq.sync.sender import WeightSender

    send_end, recv_end = in_process_pair(timeout_s=timeout_s)
    if prepare is not None:
        prepare(send_end)
    errors: dict[str, SyncError] = {}

    def receive() -> None:
        try:
            WeightReceiver(recv_end, engine.expected, verify_checksum=True).receive(
                current_version=engine.engine.weight_version, commit=engine.engine.load_weights
            )
        except SyncError as exc:
            errors["recv"] = exc

    thread = threading.Thread(target=receive)
    thread.start()
    try:
        items = weights if weights is not None else trainer.trainer.hf_weight_items()
        WeightSender(send_end, serialize=serialize or trainer.serialize, bucket_bytes=4096).sync(
            items, version
        )
    except SyncError as exc:
        errors["send"] = exc
    thread.join(timeout=30)
    assert not thread.is_alive()
    return errors.get("send"), errors.get("recv")
