"""M5: train/rollout mismatch per precision on the SAME sequences, against bf16, in one run.

For each precision a trainer and an embedded engine are built in this process from the same
starting checkpoint (`LocalPair`, weights synced through the in-process channel, the engine's copy
checked bit for bit). The sequences are sampled once, by the bf16 engine, from the task's prompts;
then every precision's trainer (`NativeTrainer.logprobs`) and engine (`EmbeddedEngine.score`,
teacher-forced at the engine's precision) score exactly those tokens. Mismatch = mean |logp_trainer -
logp_engine| over response tokens; the bar (M5) is <= 1.5x bf16's.

    python benchmarks/mismatch.py                          # tiny_moe on this machine's CPU
    python benchmarks/mismatch.py --model small_moe --device cuda --prompts 64

Needs hydra/omegaconf (the configs are composed); on a bare GPU box see docs/gpu_box.md.
"""

from __future__ import annotations

import argparse
import time

import torch

from skyq.config.store import compose, to_object
from skyq.launch.local_pair import LocalPair
from skyq.launch.pair import PairSpec
from skyq.launch.placement import placement_for
from skyq.rl.batch import RolloutBatch, collate
from skyq.rl.tasks import build_task
from skyq.trainer.native.tiny_checkpoint import ensure_tiny_checkpoint

PRECISIONS = ("bf16", "fp8_blockwise", "mxfp8", "int4_qat")


def build_pair(overrides: list[str], device: str) -> tuple[LocalPair, object]:
    cfg = to_object(compose(overrides))
    checkpoint = ensure_tiny_checkpoint(
        cfg.model, cfg.task, cache_dir=cfg.checkpoint.cache_dir, device=device
    )
    spec = PairSpec(
        model=cfg.model, precision=cfg.precision, algorithm=cfg.algorithm, trainer=cfg.trainer,
        rollout=cfg.rollout, placement=placement_for(cfg.topology, cfg.rollout.weight_sync.transport),
        checkpoint_path=str(checkpoint), seed=cfg.seed,
    )  # fmt: skip
    return LocalPair(spec), cfg


def sample_sequences(pair: LocalPair, cfg, prompts: int, group: int) -> RolloutBatch:
    task = build_task(cfg.task, seed=cfg.seed)
    chosen = task.prompts(0, prompts)
    samples = pair.generate([p.token_ids for p in chosen], n=group, max_new_tokens=cfg.task.max_response_length,
                            temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p, seed=0)  # fmt: skip
    return collate(samples, [0.0] * len(samples), group_size=group, normalize_std=False,
                   pad_token_id=task.tokenizer.eos_token_id)  # fmt: skip


def mismatch(pair: LocalPair, cfg, seqs: RolloutBatch) -> tuple[float, float]:
    trainer = pair.trainer.trainer.logprobs(seqs.input_ids, seqs.attention_mask)
    engine = pair.engine.score(seqs.input_ids, seqs.attention_mask, cfg.rollout.temperature)
    mask = seqs.response_mask.bool()
    diff = (trainer[mask] - engine[mask]).abs()
    return float(diff.mean()), float(diff.max())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny_moe")
    parser.add_argument(
        "--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"]
    )
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--precisions", nargs="+", default=list(PRECISIONS), choices=PRECISIONS)
    parser.add_argument("overrides", nargs="*", help="extra config overrides, e.g. trainer.fp8_gemm=emulated")
    args = parser.parse_args()
    if args.precisions[0] != "bf16":
        args.precisions = ["bf16", *[p for p in args.precisions if p != "bf16"]]
    base = [f"model={args.model}", f"topology={'1gpu' if args.device == 'cuda' else 'cpu'}",
            "rollout.weight_sync.transport=in_process", "precision.emulate=true", *args.overrides]  # fmt: skip
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    seqs: RolloutBatch | None = None
    results: dict[str, tuple[float, float]] = {}
    for precision in args.precisions:
        start = time.perf_counter()
        pair, cfg = build_pair([*base, f"precision={precision}"], args.device)
        try:
            pair.sync(1)
            pair.verify_engine_matches_trainer()
            if seqs is None:
                seqs = sample_sequences(pair, cfg, args.prompts, args.group)
            results[precision] = mismatch(pair, cfg, seqs)
        finally:
            pair.shutdown()
        mean, worst = results[precision]
        print(
            f"{precision:14s} mean |dlogp| {mean:.5f}  max {worst:.4f}  ({time.perf_counter() - start:.1f} s)"
        )
    assert seqs is not None
    tokens = int(seqs.response_mask.sum())
    print(f"\n{args.model}, {len(seqs)} sequences ({tokens} response tokens) sampled once by the bf16 engine, "
          f"{device_name}, torch {torch.__version__}\n")  # fmt: skip
    print(f"{'metric':34s} {'ours':>9s} {'baseline (bf16)':>16s} {'ratio':>6s}  device")
    base_mean = results["bf16"][0]
    for precision, (mean, _) in results.items():
        if precision == "bf16":
            continue
        ratio = mean / base_mean if base_mean else float("inf")
        print(f"{'M5 mismatch ' + precision:34s} {mean:9.5f} {base_mean:16.5f} {ratio:6.2f}  {device_name}")


if __name__ == "__main__":
    main()
