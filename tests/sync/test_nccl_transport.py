"""The same transport code over NCCL between two GPUs (skipped without two CUDA devices)."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_wire_tensors_cross_nccl_between_two_gpus_bit_identically():
    from .nccl_check import main

    results = main()
    assert results["receiver"][0][0] == results["expected"][0][0]  # main() raised already if not
    assert results["receiver"][0][1] == ["cuda:1"]
