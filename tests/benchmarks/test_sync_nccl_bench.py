"""benchmarks/sync_nccl.py on the CPU: the same two-process code as on two GPUs, gloo instead of NCCL."""

from __future__ import annotations

import importlib
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def test_two_process_sync_benchmark_reports_every_format_bit_identical(capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))  # the spawned ranks import the script by this path too
    bench = importlib.import_module("sync_nccl")
    results = bench.main(
        ["--device", "cpu", "--hidden", "256", "--expert-width", "32", "--layers", "1", "--repeats", "1"]
    )
    assert set(results) == {"bf16", "fp8_blockwise", "mxfp8", "int4_qat"}
    for fmt, r in results.items():
        assert r["identical"], (fmt, r["differing"])
        # the first sync sends the manifest, then the layout is kept (a warm-up and one measured sync)
        assert r["full_manifest"] == [True, False, False], fmt
        assert r["tensors_checked"] == r["tensors"], fmt
        assert r["plain"] > 0 and r["bytes"] > 0
    # the quantized formats move fewer bytes than bf16
    assert all(results[f]["bytes"] < results["bf16"]["bytes"] for f in ("fp8_blockwise", "mxfp8", "int4_qat"))
    table = capsys.readouterr().out.splitlines()
    assert table[-1].startswith("M2 two-rank sync steady int4_qat")
