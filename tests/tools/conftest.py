"""Session-wide tiny checkpoints for the converter tests (built once: transformers is slow to import)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from checkpoint.tiny_checkpoints import make_kimi_like, make_qwen3_moe, reshard, scales_apart

from skyq.tools import convert_hf_to_fp8, convert_hf_to_int4


@pytest.fixture(scope="session")
def qwen_bf16(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("qwen_bf16")
    make_qwen3_moe(d)
    return d


@pytest.fixture(scope="session")
def kimi_bf16(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("kimi_bf16")
    make_kimi_like(d)
    return d


@pytest.fixture(scope="session")
def qwen_fp8(tmp_path_factory, qwen_bf16) -> Path:
    """Our blockwise FP8 output of the Qwen3-MoE model, as written."""
    d = tmp_path_factory.mktemp("qwen") / "fp8"
    assert convert_hf_to_fp8.main(["--model-dir", str(qwen_bf16), "--save-dir", str(d)]) == 0
    return d


@pytest.fixture(scope="session")
def kimi_fp8_split(tmp_path_factory, kimi_bf16) -> Path:
    """Blockwise FP8 Kimi-like checkpoint resharded so every scale sits in another shard than its weight."""
    root = tmp_path_factory.mktemp("kimi_fp8")
    assert convert_hf_to_fp8.main(["--model-dir", str(kimi_bf16), "--save-dir", str(root / "fp8")]) == 0
    reshard(root / "fp8", root / "split", max_shard_bytes=64 * 1024, place=scales_apart)
    return root / "split"


@pytest.fixture(scope="session")
def kimi_int4_release(tmp_path_factory, kimi_bf16) -> Path:
    """A K2.6-style W4A16 release: g32 symmetric, the block under text_config, scales in other shards."""
    root = tmp_path_factory.mktemp("kimi_int4")
    assert convert_hf_to_int4.main(["--model-dir", str(kimi_bf16), "--save-dir", str(root / "int4")]) == 0
    reshard(root / "int4", root / "release", max_shard_bytes=64 * 1024, place=scales_apart)
    config_path = root / "release" / "config.json"
    config = json.loads(config_path.read_text())
    config["text_config"]["quantization_config"] = config.pop("quantization_config")
    config_path.write_text(json.dumps(config, indent=2))
    return root / "release"
