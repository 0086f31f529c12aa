"""trainer=megatron's GRPO step per precision on one GPU: Transformer Engine FP8 (and fake INT4) vs bf16.

Each precision runs in its own process (Transformer Engine reads its recipe env vars at import, and
megatron's parallel state is per process): a world of one `MegatronTrainer` (TE spec, Megatron DDP
and distributed optimizer) is built from the same random HF checkpoint, then `train_step` runs on
one synthetic rollout batch `--warmup` times untimed and `--repeats` times timed (CUDA
synchronized). The driver prints the medians side by side and each one's ratio to bf16.

    python benchmarks/megatron_step.py                                  # small_moe: bf16, fp8_blockwise, int4_qat
    python benchmarks/megatron_step.py --model bench --rows 64 --seq 512  # a wider MoE, a longer batch
    python benchmarks/megatron_step.py --precisions bf16 fp8_blockwise --json out.json

Needs a GPU with megatron-core and Transformer Engine (on the lent H200: staged, see docs/gpu_box.md).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODELS = {
    "tiny_moe": [],
    "small_moe": [],
    # a Qwen3-30B-A3B-shaped slice: its hidden and expert widths, 8 layers, 64 experts top-8
    "bench": [
        "model.hidden_size=2048", "model.num_layers=8", "model.num_attention_heads=32",
        "model.num_key_value_heads=4", "model.head_dim=128", "model.moe_intermediate_size=768",
        "model.num_experts=64", "model.num_experts_per_tok=8", "model.vocab_size=4096",
    ],
}  # fmt: skip


def one(args: argparse.Namespace) -> dict:
    """Build this process's trainer for `args.precision` and time its train_step."""
    import torch

    from skyq.config.store import compose, to_object
    from skyq.rl.batch import RolloutBatch
    from skyq.trainer.megatron.group import open_world_store
    from skyq.trainer.megatron.trainer import MegatronTrainer

    overrides = [
        f"model={'small_moe' if args.model == 'bench' else args.model}", *MODELS[args.model],
        f"precision={args.precision}", "topology=1gpu" if args.device == "cuda" else "topology=cpu", "trainer=megatron", "model.init_sft_steps=0",
        f"trainer.micro_batch_size={args.rows}",
    ]  # fmt: skip
    cfg = to_object(compose(overrides))
    start = time.perf_counter()
    trainer = MegatronTrainer(
        model_cfg=cfg.model, precision_cfg=cfg.precision, trainer_cfg=cfg.trainer,
        algorithm_cfg=cfg.algorithm, parallel_cfg=cfg.topology.parallel, checkpoint_path=args.checkpoint,
        load_path=None, ref_load=None, device=args.device, seed=0, temperature=1.0, rank=0, world_size=1,
        store=open_world_store(1, 600.0), timeout_s=600.0,
    )  # fmt: skip
    build_s = time.perf_counter() - start

    def sync() -> None:
        if args.device == "cuda":
            torch.cuda.synchronize()

    gen = torch.Generator().manual_seed(0)
    rows, seq, prompt = args.rows, args.seq, args.seq // 4
    response = torch.zeros(rows, seq)
    response[:, prompt:] = 1.0
    batch = RolloutBatch(
        input_ids=torch.randint(0, cfg.model.vocab_size, (rows, seq), generator=gen),
        attention_mask=torch.ones(rows, seq, dtype=torch.long),
        response_mask=response,
        rollout_logprobs=-torch.rand(rows, seq, generator=gen) * response,
        advantages=torch.randn(rows, generator=gen),
        rewards=torch.rand(rows, generator=gen),
    )
    for _ in range(args.warmup):
        trainer.train_step(batch)
    times = []
    for _ in range(args.repeats):
        sync()
        t0 = time.perf_counter()
        out = trainer.train_step(batch)
        sync()
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() / 2**30 if args.device == "cuda" else 0.0
    trainer.close()
    return {
        "precision": args.precision, "model": args.model, "rows": rows, "seq": seq,
        "build_s": build_s, "step_s": statistics.median(times), "step_min_s": min(times),
        "step_max_s": max(times), "grad_norm": out["grad_norm"], "peak_gib": peak,
    }  # fmt: skip


def write_checkpoint(model: str, directory: Path) -> str:
    """A random-init HF checkpoint of the model (no warm-up: the step's time does not depend on it)."""
    from skyq.config.store import compose, to_object
    from skyq.trainer.native.model import build_model, hf_state, write_hf_checkpoint

    base = "small_moe" if model == "bench" else model
    cfg = to_object(compose([f"model={base}", *MODELS[model], "model.init_sft_steps=0"]))
    write_hf_checkpoint(
        directory, hf_state(build_model(cfg.model, seed=0), cfg.model, device="cpu"), cfg.model
    )
    return str(directory)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", choices=sorted(MODELS), default="small_moe")
    parser.add_argument("--precisions", nargs="+", default=["bf16", "fp8_blockwise", "int4_qat"])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--device", default="cuda", help="cuda, or cpu (a smoke run of bf16 / int4_qat)")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--precision", help=argparse.SUPPRESS)  # one precision, in a child process
    parser.add_argument("--checkpoint", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.precision:
        print("RESULT " + json.dumps(one(args)), flush=True)
        return
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = write_checkpoint(args.model, Path(tmp) / "hf")
        for precision in args.precisions:
            cmd = [sys.executable, __file__, "--precision", precision, "--checkpoint", checkpoint,
                   "--model", args.model, "--rows", str(args.rows), "--seq", str(args.seq),
                   "--warmup", str(args.warmup), "--repeats", str(args.repeats), "--device", args.device]  # fmt: skip
            proc = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy())
            lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
            if proc.returncode or not lines:
                print(f"{precision}: failed (exit {proc.returncode})\n{proc.stderr[-4000:]}", flush=True)
                results.append({"precision": precision, "error": proc.stderr[-2000:]})
                continue
            results.append(json.loads(lines[-1].removeprefix("RESULT ")))
            print(json.dumps(results[-1]), flush=True)
    base = next((r["step_s"] for r in results if r.get("precision") == "bf16" and "step_s" in r), None)
    print(f"\nmodel={args.model} rows={args.rows} seq={args.seq} (median of {args.repeats} steps)")
    for r in results:
        if "step_s" in r:
            ratio = f"{r['step_s'] / base:.2f}x bf16" if base else ""
            print(f"{r['precision']:>14}: {r['step_s'] * 1e3:8.1f} ms  {ratio}  peak {r['peak_gib']:.1f} GiB")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
