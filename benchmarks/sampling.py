"""The engine's token draw at top_p 1, same logits and uniforms, same run: the two-level search
(`sampling.inverse_cdf`: chunk sums, a scan over the chunks, a scan inside one chunk) against one
float64 scan of every row's whole vocabulary plus a long scan for its last kept token
(`sampling.full_scan`, the only draw before the two-level `inverse_cdf`; `sample_tokens` now picks by
`FULL_SCAN_MAX_VOCAB`). Both draw the same tokens (checked); times are medians of synchronized eager calls.

    python benchmarks/sampling.py [--rows 64 256 512] [--vocab 4096 151936] [--device cuda]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import Tensor

from skyq.rollout.sampling import draw_uniforms, full_scan, inverse_cdf


def draw(search, logits: Tensor, uniforms: Tensor) -> tuple[Tensor, Tensor]:
    """`sample_tokens` at temperature 1, top_p 1, drawing with `search`."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    tokens = search(logprobs.exp(), uniforms)
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)


def timed(fn, repeats: int, device: torch.device) -> float:
    """Median seconds per call."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[64, 256, 512])
    ap.add_argument("--vocab", type=int, nargs="+", default=[4096, 151936])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device {name}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}")
    gen = torch.Generator().manual_seed(0)
    rows_out = []
    for vocab in args.vocab:
        for rows in args.rows:
            logits = (torch.randn(rows, vocab, generator=gen) * 3).to(torch.bfloat16).to(device)
            u = draw_uniforms(gen, 1, rows)[0].to(device)
            new, old = draw(inverse_cdf, logits, u), draw(full_scan, logits, u)
            same = int((new[0] == old[0]).sum())
            t_new = timed(lambda x=logits, v=u: draw(inverse_cdf, x, v), args.repeats, device)
            t_old = timed(lambda x=logits, v=u: draw(full_scan, x, v), args.repeats, device)
            print(f"{rows:>5} rows x {vocab:>6}: two-level {t_new * 1e6:9.1f} us | full scan {t_old * 1e6:9.1f} us | "
                  f"same token in {same}/{rows} rows", flush=True)  # fmt: skip
            rows_out.append((rows, vocab, t_new, t_old))
    print(f"\n{'metric':<58} {'ours':>9} {'baseline':>9} {'ratio':>6}  device")
    for rows, vocab, t_new, t_old in rows_out:
        print(f"{f'token draw us, {rows} rows x {vocab}: two-level / full scan':<58} {t_new * 1e6:>9.1f} "
              f"{t_old * 1e6:>9.1f} {t_old / t_new:>6.2f}  {name}")  # fmt: skip


if __name__ == "__main__":
    main()
