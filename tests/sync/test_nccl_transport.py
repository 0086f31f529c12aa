"""The same transport code over NCCL between two GPUs (skipped without two CUDA devices), and the
deadline poll the NCCL path waits with (CPU)."""

from __future__ import annotations

import time

import pytest
import torch

from skyq.sync.errors import SyncTimeout
from skyq.sync.torch_dist import await_work


class _Work:
    """Stands in for an NCCL collective's `Work` (NCCL cannot run on a CPU box): completes after
    `polls` calls of `is_completed`."""

    def __init__(self, polls: int) -> None:
        self.polls = polls

    def is_completed(self) -> bool:
        self.polls -= 1
        return self.polls <= 0


def test_await_work_returns_once_the_collective_completes():
    work = _Work(polls=500)
    start = time.monotonic()
    await_work(work, 5.0, "bucket 1/2 of v3")
    assert work.polls == 0 and time.monotonic() - start < 2.0


def test_await_work_raises_a_named_timeout_when_the_peer_never_answers():
    start = time.monotonic()
    with pytest.raises(
        SyncTimeout, match=r"bucket 2/9 of v4: no transfer .* within 0.3 s .*rollout\.weight_sync\.timeout_s"
    ):
        await_work(_Work(polls=10**12), 0.3, "bucket 2/9 of v4")
    assert 0.3 <= time.monotonic() - start < 3.0


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_wire_tensors_cross_nccl_between_two_gpus_bit_identically():
    from .nccl_check import main

    results = main()
    assert results["receiver"][0][0] == results["expected"][0][0]  # main() raised already if not
    assert results["receiver"][0][1] == ["cuda:1"]
