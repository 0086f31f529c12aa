"""M6: converter wall time vs just loading and saving the same shards (BENCHMARKS.md).

    python benchmarks/convert.py [--gb 1.0] [--repeats 3] [--workers 2] [--device cpu|cuda] [--out DIR]

Generates a synthetic BF16 Qwen3-MoE checkpoint of about `--gb` GB (real HF names and a real
config.json, random weights, ~256 MB shards), runs everything once untimed (page cache, CUDA and
Triton start-up, the CPU kernel's first build), then times, alternately and `--repeats` times:
the baseline (safetensors load_file + save_file of every shard, one thread) and skyq's
`convert_hf_to_fp8` (blockwise) and `convert_hf_to_int4` on `--device` (default: cuda if
available). Prints every time, medians and spread, and a table last: metric, ours, baseline, ratio
(= baseline time / our time; the bar is >= 0.5 on 2 CPU cores), device.
Needs torch, safetensors and skyq only (no hydra, omegaconf, ray or pytest).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from contextlib import redirect_stdout
from io import StringIO
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from skyq.checkpoint.device import resolve_device
from skyq.config.enums import ModelFamily
from skyq.config.schema import ModelConfig
from skyq.quant.layouts import get_layout
from skyq.tools import convert_hf_to_fp8, convert_hf_to_int4

SHARD_BYTES = 256 << 20


def model_config_for(gb: float) -> ModelConfig:
    """Qwen3-30B-A3B widths (hidden 2048, expert width 768); layers and experts scaled to `gb`."""
    layers = 2
    experts = max(4, int(gb * 1e9 / (layers * 3 * 2048 * 768 * 2)))
    return ModelConfig(
        family=ModelFamily.qwen3_moe, vocab_size=8192, hidden_size=2048, num_layers=layers, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, intermediate_size=6144, moe_intermediate_size=768,
        num_experts=experts, num_experts_per_tok=8,
    )  # fmt: skip


def hf_config_json(cfg: ModelConfig) -> dict:
    return {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "moe_intermediate_size": cfg.moe_intermediate_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim, "num_experts": cfg.num_experts, "num_experts_per_tok": cfg.num_experts_per_tok,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    }  # fmt: skip


def generate(directory: Path, cfg: ModelConfig) -> int:
    """Write the synthetic checkpoint; returns its tensor bytes."""
    directory.mkdir(parents=True)
    g = torch.Generator().manual_seed(0)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = total = 0
    for spec in get_layout(cfg.family).hf_parameters(cfg):
        t = (torch.randn(spec.shape, generator=g) * 0.02).to(spec.dtype)
        if shards[-1] and size + t.nbytes > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][spec.name] = t
        size += t.nbytes
        total += t.nbytes
    weight_map = {}
    for i, tensors in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(tensors, str(directory / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    (directory / "config.json").write_text(json.dumps(hf_config_json(cfg)))
    return total


def load_and_save(src: Path, dst: Path) -> None:
    """The baseline: read every shard and write it back, nothing else."""
    dst.mkdir(parents=True)
    for shard in sorted(src.glob("*.safetensors")):
        save_file(load_file(str(shard)), str(dst / shard.name), metadata={"format": "pt"})
        with open(dst / shard.name, "rb+") as f:
            os.fsync(f.fileno())  # our converters fsync every shard; so must the baseline


def timed(fn, out: Path) -> float:
    shutil.rmtree(out, ignore_errors=True)
    start = time.perf_counter()
    with redirect_stdout(StringIO()):
        fn(out)
    seconds = time.perf_counter() - start
    shutil.rmtree(out, ignore_errors=True)
    return seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gb", type=float, default=1.0, help="approximate checkpoint size in GB")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--workers", type=int, default=2, help="--max-workers of the converters")
    p.add_argument(
        "--device", default=None, help="converters' --device (default: cuda if available, else cpu)"
    )
    p.add_argument(
        "--out", "--dir", dest="dir", type=Path, default=None, help="scratch dir (default: a temp dir)"
    )
    args = p.parse_args()
    device = resolve_device(args.device)
    os.environ.setdefault("TQDM_DISABLE", "1")
    root = Path(tempfile.mkdtemp(prefix="skyq_bench_", dir=args.dir))
    try:
        model = root / "bf16"
        nbytes = generate(model, model_config_for(args.gb))
        w = ["--max-workers", str(args.workers), "--device", str(device)]
        runs = {
            "baseline load+save": lambda out: load_and_save(model, out),
            "convert_hf_to_fp8 block": lambda out: convert_hf_to_fp8.main(["--model-dir", str(model), "--save-dir", str(out), *w]),
            "convert_hf_to_int4 g128": lambda out: convert_hf_to_int4.main(
                ["--model-dir", str(model), "--save-dir", str(out), "--group-size", "128", *w]),
        }  # fmt: skip
        for fn in runs.values():
            timed(fn, root / "out")
        times: dict[str, list[float]] = {k: [] for k in runs}
        loads = []
        for _ in range(args.repeats):
            for name, fn in runs.items():
                times[name].append(timed(fn, root / "out"))
            loads.append(os.getloadavg()[0])
    finally:
        shutil.rmtree(root, ignore_errors=True)
    gpu = f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""
    print(
        f"checkpoint: {nbytes / 1e9:.2f} GB bf16, repeats {args.repeats}, workers {args.workers}; "
        f"{platform.machine()} {os.cpu_count()} cpu, torch {torch.__version__}; "
        f"1-min load after each repeat {'/'.join(f'{x:.1f}' for x in loads)}"
    )
    base = statistics.median(times["baseline load+save"])
    for name, ts in times.items():
        ratios = "" if name.startswith("baseline") else " ratio per repeat " + "/".join(
            f"{b / t:.2f}" for b, t in zip(times["baseline load+save"], ts))  # fmt: skip
        print(f"  {name:<26} {' '.join(f'{t:.2f}' for t in ts)} s: median {statistics.median(ts):.2f} "
              f"(min {min(ts):.2f}, max {max(ts):.2f}), {nbytes / statistics.median(ts) / 1e9:.2f} GB/s{ratios}")  # fmt: skip
    print(f"\n{'metric':<34} {'ours s':>8} {'baseline s':>11} {'ratio':>6}  device")
    for name in ("convert_hf_to_fp8 block", "convert_hf_to_int4 g128"):
        ours = statistics.median(times[name])
        print(f"{'M6 ' + name:<34} {ours:8.2f} {base:11.2f} {base / ours:6.2f}  {device}{gpu}")


if __name__ == "__main__":
    main()
