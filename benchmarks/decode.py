"""M4: decode tokens/s of an FP8 weight-only model vs the same model in bf16 (same run, same GPU).

The model is a DENSE stack shaped like Qwen3-30B-A3B's active path per token: per layer the
attention projections (q 4096x2048, k/v 512x2048, o 2048x4096) and an MLP as wide as the 8 routed
experts a token uses (gate/up 6144x2048, down 2048x6144 = 8 x 768), hidden 2048, 8 layers: 453M
parameters (906 MB bf16, 453 MB fp8, far beyond the 50 MB L2, so weights stream from HBM as in
real decode). It is not a routed MoE: every token uses the same 8 "experts", so the weight bytes
per step do not grow with the batch as real routing's would. Attention itself (softmax over the KV
cache) is left out; both sides run the same elementwise ops.

bf16 side: `F.linear` (cuBLAS). FP8 side: `dispatch.fp8_weight_only_linear` (Triton, dequantizes
in registers). One decode step of each side is captured in a CUDA graph and replayed, so launch
overhead is equal and small. tokens/s = batch / step time; medians over repeats with the spread.

    python benchmarks/decode.py [--layers 8] [--repeats 15]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from skyq.quant.kernels import dispatch

HIDDEN, Q_OUT, KV_OUT, MLP = 2048, 4096, 512, 6144
SHAPES = {"q": (Q_OUT, HIDDEN), "k": (KV_OUT, HIDDEN), "v": (KV_OUT, HIDDEN), "o": (HIDDEN, Q_OUT),
          "gate": (MLP, HIDDEN), "up": (MLP, HIDDEN), "down": (HIDDEN, MLP)}  # fmt: skip


def make_layers(n_layers: int, gen: torch.Generator) -> list[dict[str, torch.Tensor]]:
    return [
        {
            name: (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16).cuda()
            for name, shape in SHAPES.items()
        }
        for _ in range(n_layers)
    ]


def step(x: torch.Tensor, layers: list[dict], linear) -> torch.Tensor:
    for w in layers:  # RMS norms before each block keep random weights from overflowing
        h = F.rms_norm(x, (HIDDEN,))
        q, _k, _v = linear(h, w["q"]), linear(h, w["k"]), linear(h, w["v"])
        x = x + linear(q, w["o"])
        h = F.rms_norm(x, (HIDDEN,))
        x = x + linear(F.silu(linear(h, w["gate"])) * linear(h, w["up"]), w["down"])
    return x


def graphed(fn, x: torch.Tensor):
    """Capture fn(x) into a CUDA graph (after warm-up on a side stream, which compiles Triton)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn(x)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn(x)
    return g


def time_graph(g: torch.cuda.CUDAGraph, replays: int, repeats: int) -> list[float]:
    """Seconds per replay, one figure per repeat (events around `replays` back-to-back replays)."""
    out = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(replays):
            g.replay()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) / 1e3 / replays)
    return out


def copy_bandwidth() -> float:
    """Device copy bytes/s (read + write) of 1 GiB, the memory ceiling measured in this run."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(20):
        dst.copy_(src)
    b.record()
    b.synchronize()
    return 2 * src.numel() * 20 / (a.elapsed_time(b) / 1e3)


def per_shape(gen: torch.Generator, batches: list[int]) -> None:
    """Each projection alone: bf16 cuBLAS vs the FP8 kernel, achieved weight bytes/s."""
    from triton.testing import do_bench

    print("\nper projection, alone (median us; GB/s of weight bytes; weights <= 24 MB may sit in L2)")
    print(
        f"{'shape':>12} {'M':>3} {'bf16 us':>8} {'fp8 us':>8} {'bf16 GB/s':>9} {'fp8 GB/s':>9} {'speedup':>7}"
    )
    for name, (n, k) in SHAPES.items():
        if name in ("v", "up"):
            continue
        w = (torch.randn(n, k, generator=gen) * 0.02).to(torch.bfloat16).cuda()
        q, s = dispatch.quantize_fp8_blockwise(w)
        for m in batches:
            x = torch.randn(m, k, generator=gen).to(torch.bfloat16).cuda()
            tb = do_bench(lambda x=x, w=w: F.linear(x, w), warmup=25, rep=100, return_mode="median")
            tf = do_bench(
                lambda x=x, q=q, s=s: dispatch.fp8_weight_only_linear(x, q, s),
                warmup=25,
                rep=100,
                return_mode="median",
            )
            print(f"{n:>5}x{k:<6} {m:>3} {tb * 1e3:8.1f} {tf * 1e3:8.1f} {2 * n * k / tb / 1e6:9.0f} "
                  f"{n * k / tf / 1e6:9.0f} {tb / tf:7.2f}")  # fmt: skip


def sweep(gen: torch.Generator) -> None:
    """Tilings of the kernel on the two largest projections (BM, BN, TK, split) x warps."""
    from triton.testing import do_bench

    from skyq.quant.kernels import triton_fp8_gemv

    print("\nsweep (fp8 kernel median us)")
    for n, k in ((Q_OUT, HIDDEN), (HIDDEN, MLP)):
        w = (torch.randn(n, k, generator=gen) * 0.02).to(torch.bfloat16).cuda()
        q, s = dispatch.quantize_fp8_blockwise(w)
        for m in (16, 64):
            x = torch.randn(m, k, generator=gen).to(torch.bfloat16).cuda()
            auto = triton_fp8_gemv.tiling(m, n, k, 128, triton_fp8_gemv.sm_count(x.device))
            cells = []
            for bn in (32, 64, 128):
                for split in (1, 4):
                    cfg = (min(64, max(16, m)), bn, 128, split)
                    t = do_bench(
                        lambda x=x, q=q, s=s, cfg=cfg: triton_fp8_gemv.linear(x, q, s, block_size=(128, 128), config=cfg),
                        warmup=10, rep=40, return_mode="median",
                    )  # fmt: skip
                    cells.append((t * 1e3, f"bn{bn}/s{split}"))
            best = sorted(cells)[:4]
            print(f"{n}x{k} M={m} auto={auto}: " + ", ".join(f"{lab} {t:.1f}" for t, lab in best))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 32, 64])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--no-sweep", action="store_true")
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    device = torch.cuda.get_device_name()
    print(f"device {device}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}")
    print(f"copy bandwidth (read+write) {copy_bandwidth() / 1e12:.2f} TB/s")
    layers = make_layers(args.layers, gen)
    fp8 = [{name: dispatch.quantize_fp8_blockwise(w) for name, w in layer.items()} for layer in layers]
    n_params = sum(w.numel() for layer in layers for w in layer.values())
    print(f"dense Qwen3-30B-A3B-active-shaped stack: {args.layers} layers, {n_params / 1e6:.0f}M params")

    def bf16_linear(x, w):
        return F.linear(x, w)

    by_id = {id(w): fp8[i][name] for i, layer in enumerate(layers) for name, w in layer.items()}

    def fp8_linear(x, w):
        q, s = by_id[id(w)]
        return dispatch.fp8_weight_only_linear(x, q, s)

    rows = []
    for m in args.batches:
        x = torch.randn(m, HIDDEN, generator=gen).to(torch.bfloat16).cuda()
        y_b, y_f = step(x, layers, bf16_linear), step(x, layers, fp8_linear)
        rel = float((y_f.float() - y_b.float()).norm() / y_b.float().norm())
        gb = graphed(lambda t: step(t, layers, bf16_linear), x)
        gf = graphed(lambda t: step(t, layers, fp8_linear), x)
        tb, tf = [], []
        for _ in range(args.repeats):  # interleaved so drift hits both sides alike
            tb += time_graph(gb, args.replays, 1)
            tf += time_graph(gf, args.replays, 1)
        mb, mf = statistics.median(tb), statistics.median(tf)
        rows.append((m, m / mb, m / mf, mb, mf, min(tb), max(tb), min(tf), max(tf), rel))
        del gb, gf
    print("\nbatch  bf16 step us [min-max]     fp8 step us [min-max]   fp8 weight GB/s  rel.diff vs bf16")
    fp8_bytes = n_params  # one byte per weight (+ scales, 1/4096 of that)
    for m, _, _, mb, mf, b0, b1, f0, f1, rel in rows:
        print(f"{m:>5}  {mb * 1e6:8.1f} [{b0 * 1e6:.1f}-{b1 * 1e6:.1f}]   {mf * 1e6:8.1f} [{f0 * 1e6:.1f}-{f1 * 1e6:.1f}]"
              f"   {fp8_bytes / mf / 1e9:8.0f}   {rel:.2e}")  # fmt: skip
    table(rows, device)  # printed before the diagnostics too, in case a time limit cuts them
    if not args.no_sweep:
        per_shape(gen, args.batches)
        sweep(gen)
        table(rows, device)


def table(rows: list[tuple], device: str) -> None:
    print("\nmetric                       ours (fp8)   baseline (bf16)  ratio  device")
    for m, tok_b, tok_f, *_ in rows:
        print(
            f"M4 decode tok/s batch {m:<3}   {tok_f:10.0f}   {tok_b:14.0f}  {tok_f / tok_b:5.2f}  {device}",
            flush=True,
        )


if __name__ == "__main__":
    main()
