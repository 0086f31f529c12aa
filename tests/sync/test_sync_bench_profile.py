"""`benchmarks/sync.py --profile` on the CPU: one steady bf16 and fp8 sync profiled, counts reported."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "sync.py"


def test_profile_mode_reports_host_reads_and_calls_of_a_steady_sync(capsys):
    spec = importlib.util.spec_from_file_location("sync_benchmark", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    results = bench.main(
        ["--device", "cpu", "--layers", "1", "--hidden", "128", "--expert-width", "32", "--profile"]
    )
    assert set(results) == {"bf16", "fp8_blockwise"}
    for r in results.values():
        assert r["wall"] > 0 and r["calls"] > 0 and r["aten_ops"] > 0
        assert r["waits"]["cudaStreamSynchronize"] == 0  # no CUDA on this machine
    out = capsys.readouterr().out
    assert out.count("--- profile: one steady") == 2 and out.count("quantize stage, ") == 2
