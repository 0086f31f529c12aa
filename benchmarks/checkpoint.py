"""How long a run checkpoint blocks the training loop: blocking save (before and now) vs async.

    python benchmarks/checkpoint.py [--gb 1.0] [--repeats 2] [--dir /tmp/skyq-ckpt-bench]

A synthetic trainer state of about `--gb` (fp32 weights + AdamW's two moments, in the nested layout of
`NativeTrainer.state_dict`) goes through the real save code of `skyq.launch.actors`:
- "before": the previous blocking save (torch.save into a BytesIO, getvalue, temp+fsync+rename write,
  sha256 of the bytes), kept here as the baseline;
- "blocking": `write_trainer_state` (streamed to the file and hashed as written);
- "async": what the loop waits for with `checkpoint.async_save=true`: the snapshot to host memory plus
  starting the background writer (`_BackgroundSave`), and later the driver's completion (waiting for the
  writer, then the read-back sha256 of `skyq.launch.checkpointing`). The background write itself overlaps
  training and is printed for reference.
Timings are wall seconds per save, median of `--repeats`; prints a table last.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import shutil
import statistics
import time
from pathlib import Path

import torch

from skyq.checkpoint.atomic import atomic_write_bytes
from skyq.launch.actors import _BackgroundSave, _to_cpu, write_trainer_state
from skyq.launch.checkpointing import sha256_file


def trainer_state(gb: float) -> dict:
    """fp32 weights + exp_avg + exp_avg_sq in 64 MB tensors: 3 x 4 bytes per parameter."""
    n_params = int(gb * 1e9 / 12)
    per = 16 * 2**20  # parameters per tensor (64 MB fp32)
    sizes = [per] * (n_params // per) + ([n_params % per] if n_params % per else [])
    model = {f"layers.{i}.weight": torch.randn(s) for i, s in enumerate(sizes)}
    optim = {i: {"step": torch.tensor(10.0), "exp_avg": torch.randn(s), "exp_avg_sq": torch.rand(s)}
             for i, s in enumerate(sizes)}  # fmt: skip
    return {"model": model, "optimizer": {"state": optim, "param_groups": [{"lr": 3e-3}]}, "step": 10}


def clone(state: dict) -> dict:
    """What `NativeTrainer.state_dict` hands out: copies (training goes on changing the originals)."""
    return {k: clone(v) if isinstance(v, dict) else v.clone() if isinstance(v, torch.Tensor) else v
            for k, v in state.items()}  # fmt: skip


def save_before(path: Path, state: dict) -> str:
    buffer = io.BytesIO()
    torch.save({"trainer": clone(state), "rng": {"torch": torch.get_rng_state()}}, buffer)
    data = buffer.getvalue()
    atomic_write_bytes(path, data)
    return hashlib.sha256(data).hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dir", default="/tmp/skyq-ckpt-bench")
    args = ap.parse_args()
    root = Path(args.dir)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    state = trainer_state(args.gb)
    times: dict[str, list[float]] = {
        k: [] for k in ("before", "blocking", "async start", "async write", "async finish")
    }
    for r in range(args.repeats):
        t = time.perf_counter()
        save_before(root / f"before{r}.pt", state)
        times["before"].append(time.perf_counter() - t)
        t = time.perf_counter()
        write_trainer_state(root / f"blocking{r}.pt", {"trainer": _to_cpu(clone(state)), "rng": {}})
        times["blocking"].append(time.perf_counter() - t)
        path = root / f"async{r}.pt"
        t = time.perf_counter()
        saving = _BackgroundSave(path, {"trainer": _to_cpu(clone(state)), "rng": {}})
        times["async start"].append(time.perf_counter() - t)
        saving.thread.join()  # the loop would be training meanwhile
        times["async write"].append(time.perf_counter() - t)
        t = time.perf_counter()
        sha = saving.result()
        assert sha256_file(path) == sha  # the driver's read-back check at completion
        times["async finish"].append(time.perf_counter() - t)
        for f in root.glob("*.pt"):
            f.unlink()
    shutil.rmtree(root, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    blocked_async = med["async start"] + med["async finish"]
    print(f"trainer state {args.gb:.2f} GB, {args.repeats} repeats; per repeat: "
          + "; ".join(f"{k} " + "/".join(f"{x:.2f}" for x in v) for k, v in times.items()))  # fmt: skip
    print(f"(async write, overlapping training: {med['async write']:.2f} s)")
    print(f"\n{'metric':44s} {'ours s':>8s} {'baseline s':>11s} {'ratio':>6s}  machine")
    for name, ours in (("blocking save (streamed, hashed as written)", med["blocking"]),
                       ("async save: loop blocked (start + finish)", blocked_async)):  # fmt: skip
        print(f"{name:44s} {ours:8.2f} {med['before']:11.2f} {ours / med['before']:6.2f}  cpu")


if __name__ == "__main__":
    main()
