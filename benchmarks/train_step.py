"""The trainer's GRPO step per precision, side by side in one process: where an RL step's training time goes.

For each precision a `LocalPair` (trainer and embedded engine in this process, weights synced through
the in-process channel) is built from the same starting checkpoint; its engine samples one rollout
batch of the task's prompts (the run's own shapes: algorithm.global_batch_size responses,
trainer.micro_batch_size a micro-batch). Then `NativeTrainer.train_step` runs on that batch
repeatedly, the precisions interleaved, and its wall time (host and device, synchronized) is
reported as medians with the spread. `--profile` adds, per precision, one profiled step: device
time per kernel, the step's device busy time against its wall time, and the host ops that took
the most CPU time. `--new-lengths N` then times, per precision, the first step at each of N sequence
lengths the process has not seen (the batch right-padded by 1..N positions, masked out), and a
second step at that length: what a run pays when its padded length changes (RL batches' lengths do,
step to step), e.g. per-shape kernel plans or compilations.

    python benchmarks/train_step.py --device cuda                      # small_moe, bf16 vs fp8_blockwise
    python benchmarks/train_step.py --device cuda --profile --repeats 5
    python benchmarks/train_step.py --device cuda --new-lengths 4      # + first steps at new lengths
    python benchmarks/train_step.py --model tiny_moe --device cpu      # anywhere

Needs hydra/omegaconf (the configs are composed); on a bare GPU box see docs/gpu_box.md.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from mismatch import build_pair, sample_sequences

from skyq.rl.batch import RolloutBatch


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed_step(trainer, batch) -> float:
    sync()
    t0 = time.perf_counter()
    trainer.train_step(batch)
    sync()
    return time.perf_counter() - t0


def right_padded(batch: RolloutBatch, extra: int) -> RolloutBatch:
    """`batch` with `extra` more positions on the right, masked out of attention and loss (their
    tokens repeat each row's last one): the same sequences at a longer padded length."""

    def pad(t, value):
        return torch.nn.functional.pad(t, (0, extra), value=value)

    ids = torch.cat([batch.input_ids, batch.input_ids[:, -1:].expand(-1, extra)], dim=1)
    return RolloutBatch(ids, pad(batch.attention_mask, 0), pad(batch.response_mask, 0.0),
                        pad(batch.rollout_logprobs, 0.0), batch.advantages, batch.rewards)  # fmt: skip


def profile_step(trainer, batch, label: str, top: int) -> None:
    """One profiled train_step: kernels by device time, busy vs wall, host ops by CPU time."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    sync()
    t0 = time.perf_counter()
    with profile(activities=acts) as prof:
        trainer.train_step(batch)
        sync()
    wall = time.perf_counter() - t0
    events = prof.key_averages()
    kernels = sorted(
        ((e.self_device_time_total, e.count, e.key) for e in events if e.self_device_time_total > 0),
        reverse=True,
    )
    busy = sum(k[0] for k in kernels)
    print(f"\n{label}: profiled step {wall * 1e3:.1f} ms wall, device busy {busy / 1e3:.1f} ms "
          f"({busy / 1e6 / wall:.0%}), {sum(k[1] for k in kernels)} device ops")  # fmt: skip
    for us, count, key in kernels[:top]:
        print(f"  {us / 1e3:8.2f} ms  {count:6d} x  {key[:100]}")
    host = sorted(((e.self_cpu_time_total, e.count, e.key) for e in events), reverse=True)
    print(f"  host ops by self CPU time (of {sum(h[0] for h in host) / 1e3:.1f} ms):")
    for us, count, key in host[:top]:
        print(f"  {us / 1e3:8.2f} ms  {count:6d} x  {key[:100]}")
    print("  aten ops by calls:")
    calls = sorted(
        ((e.count, e.self_cpu_time_total, e.key) for e in events if e.key.startswith("aten::")), reverse=True
    )
    for count, us, key in calls[:top]:
        print(f"  {count:6d} x  {us / 1e3:8.2f} ms  {key[:100]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="small_moe")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--precisions", nargs="+", default=["bf16", "fp8_blockwise"])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument(
        "--new-lengths",
        type=int,
        default=0,
        metavar="N",
        help="time the first step at N sequence lengths not seen before (1..N positions longer)",
    )
    ap.add_argument("overrides", nargs="*", help="extra Hydra overrides for every precision")
    args = ap.parse_args()
    topology = "1gpu" if args.device == "cuda" else "cpu"
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"device {device_name}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}")
    sides = {}
    for precision in args.precisions:
        overrides = [f"model={args.model}", f"precision={precision}", f"topology={topology}",
                     "rollout=embedded", "task=arith", "rollout.weight_sync.transport=in_process",
                     *args.overrides]  # fmt: skip
        pair, cfg = build_pair(overrides, args.device)
        pair.sync(1)
        batch = sample_sequences(
            pair, cfg, cfg.algorithm.global_batch_size // cfg.algorithm.group_size, cfg.algorithm.group_size
        )
        trainer = pair.trainer.trainer
        timed_step(trainer, batch)  # warm-up: kernels compiled, allocator primed
        sides[precision] = (pair, trainer, batch)
        tokens = int(batch.attention_mask.sum())
        print(f"{precision}: batch {tuple(batch.input_ids.shape)}, {tokens} tokens, "
              f"micro-batch {cfg.trainer.micro_batch_size}, compute {cfg.trainer.compute_dtype.value}")  # fmt: skip
    times = {p: [] for p in sides}
    for _ in range(args.repeats):  # interleaved so drift hits every side alike
        for p, (_, trainer, batch) in sides.items():
            times[p].append(timed_step(trainer, batch))
    if args.profile:
        for p, (_, trainer, batch) in sides.items():
            profile_step(trainer, batch, p, args.top)
    new_lengths = {}
    for p, (_, trainer, batch) in sides.items():
        for extra in range(1, args.new_lengths + 1):
            longer = right_padded(batch, extra)
            new_lengths.setdefault(p, []).append((timed_step(trainer, longer), timed_step(trainer, longer)))
        if args.new_lengths:
            print(f"{p}: first / second step at lengths +1..+{args.new_lengths}, ms: "
                  + ", ".join(f"{a * 1e3:.0f} / {b * 1e3:.0f}" for a, b in new_lengths[p]))  # fmt: skip
    base = statistics.median(times[args.precisions[0]])
    print(f"\n{'metric':<40} {'ours ms':>9} {'baseline ms':>12} {'ratio':>6}  device")
    for p, ts in times.items():
        med = statistics.median(ts)
        print(f"{f'train step {p} [{min(ts) * 1e3:.0f}-{max(ts) * 1e3:.0f} ms]':<40} {med * 1e3:9.1f} "
              f"{base * 1e3:12.1f} {base / med:6.2f}  {device_name}")  # fmt: skip
    for p, pairs in new_lengths.items():  # baseline: the same step at a length already seen
        first, again = statistics.median(a for a, _ in pairs), statistics.median(b for _, b in pairs)
        print(f"{f'first step at a new length {p}':<40} {first * 1e3:9.1f} {again * 1e3:12.1f} "
              f"{again / first:6.2f}  {device_name}")  # fmt: skip
    for pair, _, _ in sides.values():
        pair.shutdown()


if __name__ == "__main__":
    main()
