"""M3: FP8 blockwise linear vs bf16, forward + backward with quantization included.

    python benchmarks/fp8_linear.py [--rounds 5] [--json out.json]

Shapes (M tokens, N out, K in) are Qwen3-30B-A3B's: routed-expert gate+up (N = 2 x 768) and down
(K = 768), attention q and o projections. Per shape, side by side in one process:
- gemm: the forward GEMM alone, bf16 `x @ w.T` vs cuBLAS blockwise `scaled_mm` on ready operands;
- fwd+bwd: `torch.autograd.grad` of the layer (y, dx, dw) with every quantization inside it:
  `fp8` re-quantizes the weight each call, `fp8 (w cached)` reuses it as a training step does
  across microbatches (the weight changes once per optimizer step);
- eager launches and CUDA-graph replays (the latter without CPU launch overhead);
- blocks: q/k/v reading one activation, which the fp8 side quantizes once for all three.
Ratios are bf16 time / fp8 time: median over rounds, [min, max] spread. Needs an SM90 GPU.
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import json
import pstats
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
import triton.testing

from skyq.trainer.fp8_linear import (
    blockwise_gemm,
    forget_last_activation,
    fp8_blockwise_linear,
    quantize_rows,
    quantize_weight,
)

SHAPES = {
    "expert gate_up 8192x1536x2048": (8192, 1536, 2048),
    "expert gate_up 16384x1536x2048": (16384, 1536, 2048),
    "expert down 8192x2048x768": (8192, 2048, 768),
    "attn q 4096x4096x2048": (4096, 4096, 2048),
    "attn o 8192x2048x4096": (8192, 2048, 4096),
}


def time_ms(fn: Callable[[], object]) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")


def graphed(fn: Callable[[], object]) -> Callable[[], object]:
    """Capture `fn` (already warmed up) into a CUDA graph; returns the replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def variants(m: int, n: int, k: int) -> tuple[dict[str, Callable[[], object]], float]:
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(n, k, device="cuda") / k**0.5).to(torch.bfloat16).requires_grad_()
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    ops = quantize_weight(w)
    xq, xs = quantize_rows(x.detach())
    xd = x.detach()
    wd = w.detach()

    def bf16_step():
        return torch.autograd.grad(F.linear(x, w), (x, w), dy)

    # Every call quantizes x: the same x fed again would reuse the previous call's quantization
    # (meant for linears that share an input), which a real training step never does for one linear.
    def fp8_step():
        forget_last_activation()
        return torch.autograd.grad(fp8_blockwise_linear(x, w), (x, w), dy)

    def fp8_cached_step():
        forget_last_activation()
        return torch.autograd.grad(fp8_blockwise_linear(x, w, weight_operands=ops), (x, w), dy)

    fns = {
        "gemm bf16": lambda: xd @ wd.t(),
        "gemm fp8": lambda: blockwise_gemm(
            xq, xs, ops.q.t(), ops.scale_fwd, b_blocks=True, out_dtype=torch.bfloat16, emulate=False
        ),
        "fwd+bwd bf16": bf16_step,
        "fwd+bwd fp8": fp8_step,
        "fwd+bwd fp8 (w cached)": fp8_cached_step,
    }
    for name in ("fwd+bwd bf16", "fwd+bwd fp8", "fwd+bwd fp8 (w cached)"):
        fns[name + " graph"] = graphed(fns[name])
    forget_last_activation()
    y8 = fp8_blockwise_linear(xd, wd)
    y16 = F.linear(xd, wd)
    rel = float((y8.double() - y16.double()).norm() / y16.double().norm())
    return fns, rel


BLOCKS = {
    "attn q/k/v 4096x(4096+512+512)x2048": (4096, (4096, 512, 512), 2048),
    "attn q/k/v 8192x(4096+512+512)x2048": (8192, (4096, 512, 512), 2048),
}
"""Linears that read one activation (the attention block's normed input feeds q, k and v): the
fp8 side quantizes it once for all three (`fp8_linear._LastActivation`), as a model's forward does."""


def block_variants(m: int, ns: tuple[int, ...], k: int) -> dict[str, Callable[[], object]]:
    """fwd+bwd of the linears `ns` reading one x [m, k] (gradients of x and every weight), bf16 vs
    fp8 with the weights cached as across microbatches; eager and graphed."""
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    ws = [(torch.randn(n, k, device="cuda") / k**0.5).to(torch.bfloat16).requires_grad_() for n in ns]
    dys = [torch.randn(m, n, device="cuda", dtype=torch.bfloat16) for n in ns]
    ops = [quantize_weight(w) for w in ws]

    def bf16_step():
        return torch.autograd.grad([F.linear(x, w) for w in ws], (x, *ws), dys)

    def fp8_step():
        forget_last_activation()  # each step quantizes x once, shared by its linears
        ys = [fp8_blockwise_linear(x, w, weight_operands=o) for w, o in zip(ws, ops)]
        return torch.autograd.grad(ys, (x, *ws), dys)

    fns = {"fwd+bwd bf16": bf16_step, "fwd+bwd fp8 (w cached)": fp8_step}
    for name in list(fns):
        fns[name + " graph"] = graphed(fns[name])
    return fns


def host_overhead(m: int, n: int, k: int) -> dict[str, float]:
    """Host (CPU) microseconds per call: launches only, the GPU queue absorbing the work."""
    from skyq.quant.kernels import triton_fp8_act

    fns, _ = variants(m, n, k)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    parts = {
        "quantize_rows_cols launch": lambda: triton_fp8_act.quantize_rows_cols(x),
        "quantize_weight launch": lambda: quantize_weight(w),
        "scaled_mm call": fns["gemm fp8"],
        "bf16 mm call": fns["gemm bf16"],
        "fwd+bwd fp8 (w cached)": fns["fwd+bwd fp8 (w cached)"],
        "fwd+bwd bf16": fns["fwd+bwd bf16"],
    }
    out = {}
    for name, fn in parts.items():
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(20):
            fn()
        out[name] = (time.perf_counter() - t0) / 20 * 1e6
        torch.cuda.synchronize()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(20):
        fns["fwd+bwd fp8 (w cached)"]()
    profiler.disable()
    torch.cuda.synchronize()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(14)
    return out


def profile_kernels(label: str, fns: dict[str, Callable[[], object]]) -> None:
    """GPU time per kernel of 10 eager fwd+bwd steps, bf16 and fp8 (w cached), for one shape."""
    for name in ("fwd+bwd bf16", "fwd+bwd fp8 (w cached)"):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                fns[name]()
            torch.cuda.synchronize()
        print(f"\nkernels of 10 x {name}, {label}:")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=70))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", default=None)
    parser.add_argument(
        "--rows-cols",
        type=int,
        nargs=2,
        metavar=("NUM_WARPS", "SUB"),
        default=None,
        help="two-orientation activation kernel config (SUB 128 = whole tile); default: the module's",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="also print the GPU kernels of one fwd+bwd per shape (torch.profiler)",
    )
    args = parser.parse_args()
    if args.rows_cols:
        from skyq.quant.kernels import triton_fp8_act

        triton_fp8_act.ROWS_COLS_NUM_WARPS, triton_fp8_act.ROWS_COLS_SUB = args.rows_cols
    device = torch.cuda.get_device_name()
    torch.manual_seed(0)
    results: dict[str, dict] = {}
    for label, (m, n, k) in SHAPES.items():
        fns, rel = variants(m, n, k)
        times: dict[str, list[float]] = {name: [] for name in fns}
        for _ in range(args.rounds):
            for name, fn in fns.items():
                times[name].append(time_ms(fn))
        ratios = {
            "gemm": [b / f for b, f in zip(times["gemm bf16"], times["gemm fp8"])],
            "fwd+bwd": [b / f for b, f in zip(times["fwd+bwd bf16"], times["fwd+bwd fp8"])],
            "fwd+bwd w cached": [
                b / f for b, f in zip(times["fwd+bwd bf16"], times["fwd+bwd fp8 (w cached)"])
            ],
            "fwd+bwd graph": [b / f for b, f in zip(times["fwd+bwd bf16 graph"], times["fwd+bwd fp8 graph"])],
            "fwd+bwd graph w cached": [
                b / f for b, f in zip(times["fwd+bwd bf16 graph"], times["fwd+bwd fp8 (w cached) graph"])
            ],
        }
        gemm_tflops = 2 * m * n * k / statistics.median(times["gemm fp8"]) / 1e9
        results[label] = {
            "mnk": [m, n, k],
            "ms": {name: statistics.median(t) for name, t in times.items()},
            "ratio": {name: [statistics.median(r), min(r), max(r)] for name, r in ratios.items()},
            "fp8_gemm_tflops": gemm_tflops,
            "rel_err_fp8_vs_bf16_forward": rel,
        }
        if args.profile:
            profile_kernels(label, fns)
        del fns
        torch.cuda.empty_cache()
    blocks: dict[str, dict] = {}
    for label, (m, ns, k) in BLOCKS.items():
        fns = block_variants(m, ns, k)
        times = {name: [] for name in fns}
        for _ in range(args.rounds):
            for name, fn in fns.items():
                times[name].append(time_ms(fn))
        blocks[label] = {
            "ms": {name: statistics.median(t) for name, t in times.items()},
            "ratio": {
                key: [
                    f(
                        b / q
                        for b, q in zip(times["fwd+bwd bf16" + sfx], times["fwd+bwd fp8 (w cached)" + sfx])
                    )
                    for f in (statistics.median, min, max)
                ]
                for key, sfx in (("eager w cached", ""), ("graph w cached", " graph"))
            },
        }
        del fns
        torch.cuda.empty_cache()
    overhead = host_overhead(*SHAPES["expert gate_up 8192x1536x2048"])
    print("host us per call (8192x1536x2048): " + ", ".join(f"{k} {v:.0f}" for k, v in overhead.items()))
    record = {
        "host_us_per_call": overhead,
        "date": datetime.date.today().isoformat(),
        "device": device,
        "torch": torch.__version__,
        "rounds": args.rounds,
        "results": results,
        "blocks": blocks,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=2)
    print(f"\ntimes (ms, median of {args.rounds} rounds):")
    for label, r in results.items():
        print(f"  {label}: " + ", ".join(f"{k} {v:.3f}" for k, v in r["ms"].items()))
        print(
            f"    fp8 GEMM {r['fp8_gemm_tflops']:.0f} TFLOP/s; forward rel. diff fp8 vs bf16 {r['rel_err_fp8_vs_bf16_forward']:.2e}"
        )
    print("\n| metric | ours | baseline | ratio | device |")
    print("|---|---|---|---|---|")
    for label, r in results.items():
        g = r["ratio"]["gemm"][0]
        for key in ("fwd+bwd", "fwd+bwd w cached", "fwd+bwd graph", "fwd+bwd graph w cached"):
            med, lo, hi = r["ratio"][key]
            applies = g >= 1.4
            verdict = ("PASS" if med >= 1.3 else "MISS") if applies else "n/a (gemm < 1.4x)"
            ours = r["ms"][
                "fwd+bwd fp8"
                + (" (w cached)" if "cached" in key else "")
                + (" graph" if "graph" in key else "")
            ]
            base = r["ms"]["fwd+bwd bf16" + (" graph" if "graph" in key else "")]
            print(
                f"| M3 {label} {key} (gemm alone {g:.2f}x; bar 1.3: {verdict}) | {ours:.3f} ms | bf16 {base:.3f} ms | "
                f"{med:.2f}x [{lo:.2f}-{hi:.2f}] | {device} |"
            )

    for label, r in blocks.items():
        for key, (med, lo, hi) in r["ratio"].items():
            sfx = " graph" if "graph" in key else ""
            print(
                f"| M3 block {label} fwd+bwd {key} (x quantized once) | {r['ms']['fwd+bwd fp8 (w cached)' + sfx]:.3f} ms "
                f"| bf16 {r['ms']['fwd+bwd bf16' + sfx]:.3f} ms | {med:.2f}x [{lo:.2f}-{hi:.2f}] | {device} |"
            )


if __name__ == "__main__":
    main()
