"""Fault injection: SIGKILL each converter at a random moment, rerun, and compare bytes with an
uninterrupted run (temp + fsync + rename, done-log, index/config/manifest last)."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
from checkpoint.tiny_checkpoints import dir_bytes

from skyq.checkpoint.atomic import TEMP_MARKER
from skyq.checkpoint.output import DONE_LOG_NAME
from skyq.tools import (
    convert_fp8_to_bf16,
    convert_hf_to_fp8,
    convert_hf_to_int4,
    convert_hf_to_mxfp8,
    convert_moe_int4_to_bf16,
)

# tool module -> (source fixture, output flag, its main)
CASES = {
    "convert_hf_to_fp8": ("qwen_bf16", "--save-dir", convert_hf_to_fp8.main),
    "convert_hf_to_int4": ("kimi_bf16", "--save-dir", convert_hf_to_int4.main),
    "convert_hf_to_mxfp8": ("kimi_bf16", "--save-dir", convert_hf_to_mxfp8.main),
    "convert_fp8_to_bf16": ("kimi_fp8_split", "--save-dir", convert_fp8_to_bf16.main),
    "convert_moe_int4_to_bf16": ("kimi_int4_release", "--output-dir", convert_moe_int4_to_bf16.main),
}
_REFERENCES: dict[str, tuple[Path, float]] = {}


def _reference(tool: str, source: Path, tmp_path_factory) -> tuple[Path, float]:
    """An uninterrupted in-process run (once per tool) and how long its conversion took."""
    if tool not in _REFERENCES:
        _, flag, main = CASES[tool]
        out = tmp_path_factory.mktemp(f"ref_{tool}") / "out"
        start = time.perf_counter()
        assert main(["--model-dir", str(source), flag, str(out), "--max-workers", "2"]) == 0
        _REFERENCES[tool] = (out, time.perf_counter() - start)
    return _REFERENCES[tool]


SEEDS = (0, 1, 2)


@pytest.mark.parametrize("tool", sorted(CASES))
def test_killed_converter_resumes_to_byte_identical_output(tool, request, tmp_path, tmp_path_factory):
    """One run per seed, started together (torch's import dominates a run here), each SIGKILLed at
    a random moment after its conversion began, then finished by a second run."""
    fixture, flag, main = CASES[tool]
    source = request.getfixturevalue(fixture)
    reference, seconds = _reference(tool, source, tmp_path_factory)
    env = dict(os.environ, TQDM_DISABLE="1")
    runs = []
    for seed in SEEDS:
        out = tmp_path / f"out{seed}"
        args = ["--model-dir", str(source), flag, str(out), "--max-workers", "2"]
        proc = subprocess.Popen([sys.executable, "-m", f"skyq.tools.{tool}", *args], env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)  # fmt: skip
        runs.append(
            {"out": out, "args": args, "proc": proc, "delay": random.Random(seed).uniform(0, 1.5 * seconds)}
        )
    deadline = time.monotonic() + 120
    while any("killed" not in r for r in runs) and time.monotonic() < deadline:
        now = time.monotonic()
        for r in runs:
            if "killed" in r:
                continue
            if "began" not in r and ((r["out"] / DONE_LOG_NAME).exists() or r["proc"].poll() is not None):
                r["began"] = now  # the conversion has begun once the done-log exists
            if "began" in r and now >= r["began"] + r["delay"]:
                r["proc"].kill()
                r["killed"] = r["proc"].wait()
        time.sleep(0.002)
    assert any(r.get("killed") == -9 for r in runs), "no run was killed before it finished"
    for r in runs:
        assert r.get("killed") in (0, -9), r["proc"].stderr.read().decode()
        assert main(r["args"]) == 0
        assert not any(TEMP_MARKER in p.name for p in r["out"].iterdir())
        assert dir_bytes(r["out"]) == dir_bytes(reference)
