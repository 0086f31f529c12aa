"""M4: decode tokens/s of an FP8 weight-only model vs the same model in bf16 (same run, same GPU).

The model is a DENSE stack shaped like Qwen3-30B-A3B's active path per token: per layer the
attention projections (q 4096x2048, k/v 512x2048, o 2048x4096) and an MLP as wide as the 8 routed
experts a token uses (gate/up 6144x2048, down 2048x6144 = 8 x 768), hidden 2048, 8 layers: 453M
parameters (906 MB bf16, 453 MB fp8, far beyond the 50 MB L2, so weights stream from HBM as in
real decode). It is not a routed MoE: every token uses the same 8 "experts", so the weight bytes
per step do not grow with the batch as real routing's would. Attention itself (softmax over the KV
cache) is left out; both sides run the same elementwise ops.

bf16 side: `F.linear` (cuBLAS). FP8 side: `fp8_linear.fp8_weight_only_linear` (dequantizes in
registers: the Gluon kernel at <= 16 rows, the Triton one above). One decode step of each side is captured in a CUDA graph and replayed, so launch
overhead is equal and small. tokens/s = batch / step time; medians over repeats with the spread.

    python benchmarks/decode.py [--layers 8] [--repeats 15] [--fused]
    python benchmarks/decode.py --gluon --fused [--no-sweep]   # + the Triton kernel beside, Gluon sweep
    python benchmarks/decode.py --only gluon-sweep --shapes 1536x1024 --batches 32 64   # one sweep, any shapes
    python benchmarks/decode.py --only large --batches 64 128 256 512 1024   # dense linears past 64 rows
    python benchmarks/decode.py --only int4 --batches 1 16 32 64 --tokens 1 8 64 256   # INT4 W4A16 decode
    python benchmarks/decode.py --only int4-sweep --batches 1 8 16 32 64 --tokens 1 8 64 256   # Gluon INT4 tiles
    python benchmarks/decode.py --only mxfp8-sweep --batches 1 8 16 32 64 --tokens 1 8 64 256  # Gluon MXFP8 tiles
    python benchmarks/decode.py --only mxfp8 --batches 32 64 65 128 256 [--shapes 1536x1024]  # dense MXFP8 row limit
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from skyq.quant.kernels import dispatch
from skyq.rollout.kernels import fp8_linear, triton_fp8_w8a8

HIDDEN, Q_OUT, KV_OUT, MLP = 2048, 4096, 512, 6144
SHAPES = {"q": (Q_OUT, HIDDEN), "k": (KV_OUT, HIDDEN), "v": (KV_OUT, HIDDEN), "o": (HIDDEN, Q_OUT),
          "gate": (MLP, HIDDEN), "up": (MLP, HIDDEN), "down": (HIDDEN, MLP)}  # fmt: skip


FUSED_SHAPES = {"qkv": (Q_OUT + 2 * KV_OUT, HIDDEN), "o": (HIDDEN, Q_OUT), "gate_up": (2 * MLP, HIDDEN),
                "down": (HIDDEN, MLP)}  # fmt: skip
"""`--fused`: q/k/v one weight and gate/up one weight (as vLLM's QKV and merged column linears hold them),
on both sides. Every row count is a multiple of 128, so the fused FP8 weight's codes and block scales are
the separate weights' stacked: one launch instead of three (two) over the same bytes."""


def make_layers(n_layers: int, gen: torch.Generator, fused: bool = False) -> list[dict[str, torch.Tensor]]:
    shapes = FUSED_SHAPES if fused else SHAPES
    return [
        {
            name: (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16).cuda()
            for name, shape in shapes.items()
        }
        for _ in range(n_layers)
    ]


def step(x: torch.Tensor, layers: list[dict], linear) -> torch.Tensor:
    if "qkv" in layers[0]:
        return step_fused(x, layers, linear)
    for w in layers:  # RMS norms before each block keep random weights from overflowing
        h = F.rms_norm(x, (HIDDEN,))
        q, _k, _v = linear(h, w["q"]), linear(h, w["k"]), linear(h, w["v"])
        x = x + linear(q, w["o"])
        h = F.rms_norm(x, (HIDDEN,))
        x = x + linear(F.silu(linear(h, w["gate"])) * linear(h, w["up"]), w["down"])
    return x


def step_fused(x: torch.Tensor, layers: list[dict], linear) -> torch.Tensor:
    for w in layers:
        h = F.rms_norm(x, (HIDDEN,))
        q = linear(h, w["qkv"])[:, :Q_OUT]  # k and v (the rest) feed attention, left out here
        x = x + linear(q, w["o"])
        h = F.rms_norm(x, (HIDDEN,))
        gate, up = linear(h, w["gate_up"]).split(MLP, dim=-1)
        x = x + linear(F.silu(gate) * up, w["down"])
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


PER_SHAPE = {"attn 2048x2048": (2048, 2048), "gate_up 6144x2048": (6144, 2048),
             "down 2048x6144": (2048, 6144), "expert 768x2048": (768, 2048),
             "lm_head 151936x2048": (151936, 2048)}  # fmt: skip


def rotated(n: int, k: int, gen: torch.Generator) -> tuple[list, list]:
    """Enough (bf16, fp8) copies of one weight shape that a pass over them (>= 256 MB of fp8)
    cannot be served from the 50 MB L2, as each layer's weights are not in real decode."""
    copies = max(1, min(64, (256 << 20) // (n * k)))
    w = (torch.randn(n, k, generator=gen) * 0.02).to(torch.bfloat16).cuda()
    ws = [w.clone() for _ in range(copies)]
    return ws, [dispatch.quantize_fp8_blockwise(wi) for wi in ws]


def time_per_call(fns: list, replays: int = 10) -> float:
    """Seconds per call of a CUDA graph that makes every call in `fns` once (launch gaps out)."""
    g = graphed(lambda _: [f() for f in fns], torch.empty(0))
    return statistics.median(time_graph(g, replays, 5)) / len(fns)


def per_call_floor(gen: torch.Generator) -> None:
    """The fixed cost of a decode call: graphed calls over rotating weights from a 16-row weight (32 KB
    of codes) up, bf16 (cuBLAS) beside the Gluon kernel, and a trivial graphed kernel for the launch."""
    from skyq.rollout.kernels import gluon_fp8_gemv as g
    from skyq.rollout.kernels import triton_fp8_gemv as kern

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    t0 = torch.zeros(16, device="cuda")
    print(
        f"\na trivial elementwise kernel: {time_per_call([lambda: t0.add_(1.0) for _ in range(64)]) * 1e6:.2f} us a call"
    )
    print(f"{'N x K':>12} {'rows':>4} {'fp8 MB':>7} {'bf16 us':>8} {'gluon us':>9}")
    for n, k in [
        (16, 2048),
        (128, 2048),
        (512, 2048),
        (2048, 2048),
        (2048, 4096),
        (5120, 2048),
        (12288, 2048),
    ]:
        ws, qs = rotated(n, k, gen)
        for m in (1, 16):
            x = torch.randn(m, k, generator=gen).to(torch.bfloat16).cuda()
            tb = time_per_call([lambda w=w, x=x: torch.matmul(x, w.T) for w in ws])
            tg = time_per_call([lambda q=q, s=s, x=x: g.linear(
                x, q, s, block_size=(128, 128), sms=sms, counters=kern._arrival_counters) for q, s in qs])  # fmt: skip
            print(
                f"{f'{n} x {k}':>12} {m:>4} {n * k / 1e6:>7.2f} {tb * 1e6:>8.2f} {tg * 1e6:>9.2f}", flush=True
            )
        del ws, qs


def bf16_and_fp8_per_call(x: torch.Tensor, ws: list, qs: list) -> tuple[float, float]:
    """Seconds per call of x @ w^T over the weight copies: bf16 `torch.matmul`, FP8 weight-only kernel."""
    tb = time_per_call([lambda w=w: torch.matmul(x, w.T) for w in ws])
    return tb, time_per_call([lambda q=q, s=s: fp8_linear.fp8_weight_only_linear(x, q, s) for q, s in qs])


def per_shape(gen: torch.Generator, batches: list[int]) -> None:
    """Each projection alone: bf16 torch.matmul vs the FP8 kernel, achieved weight-read TB/s."""
    print("\nper projection, graphed over rotating weight copies (us per call; weight-read TB/s)")
    print(
        f"{'shape':>22} {'M':>3} {'bf16 us':>8} {'fp8 us':>8} {'bf16 TB/s':>9} {'fp8 TB/s':>9} {'speedup':>7}"
    )
    for label, (n, k) in PER_SHAPE.items():
        ws, qs = rotated(n, k, gen)
        for m in batches:
            x = torch.randn(m, k, generator=gen).to(torch.bfloat16).cuda()
            tb, tf = bf16_and_fp8_per_call(x, ws, qs)
            fp8_bytes = n * k + qs[0][1].numel() * 4
            print(f"{label:>22} {m:>3} {tb * 1e6:8.1f} {tf * 1e6:8.1f} {2 * n * k / tb / 1e12:9.2f} "
                  f"{fp8_bytes / tf / 1e12:9.2f} {tb / tf:7.2f}", flush=True)  # fmt: skip
        del ws, qs


LARGE_SHAPES = {"small_moe q/k/v 1536x1024": (1536, 1024), "small_moe o 1024x1024": (1024, 1024),
                "a3b q/k/v 5120x2048": (5120, 2048), "a3b o 2048x4096": (2048, 4096)}  # fmt: skip


W8A8_DENSE_CONFIGS = [  # (BM, BN, MT (0: one program a row tile), warps, stages) of triton_fp8_w8a8
    (32, 64, 0, 4, 3), (64, 64, 0, 4, 3), (128, 64, 0, 4, 3), (64, 128, 0, 4, 3), (128, 128, 0, 8, 3),
    (64, 64, 0, 4, 4), (32, 64, 0, 4, 4),
]  # fmt: skip


def large(gen: torch.Generator, batches: list[int], w8a8_configs: bool = False) -> None:
    """A dense linear at decode batches past 64 rows: bf16, the FP8 weight-only kernel, the FP8
    weight dequantized then multiplied (the engine's path above `DECODE_MAX_ROWS` before the FP8 x
    FP8 kernel), and the FP8 x FP8 kernel with its input's 1 x 128 quantization in the call (the
    engine's path now), graphed over rotating weight copies; the engine's attention projections."""
    print(
        "\nus per call: bf16 | fp8 weight-only kernel | fp8 dequantized + bf16 GEMM | fp8 x fp8 (+ act quant)"
    )
    device = torch.cuda.get_device_name()
    rows = []
    with torch.inference_mode(), dispatch.deferred_finite_checks(max_pending=1 << 30):
        for label, (n, k) in LARGE_SHAPES.items():
            ws, qs = rotated(n, k, gen)
            for m in batches:
                x = torch.randn(m, k, generator=gen).to(torch.bfloat16).cuda()
                tb, tk = bf16_and_fp8_per_call(x, ws, qs)
                td = time_per_call(
                    [lambda q=q, s=s, x=x: torch.matmul(x, dispatch.dequantize_fp8_blockwise(q, s).T) for q, s in qs]
                )  # fmt: skip
                tw = time_per_call(
                    [lambda q=q, s=s, x=x: fp8_linear.fp8_w8a8_linear(*dispatch.quantize_fp8_activation(x), q, s)
                     for q, s in qs]
                )  # fmt: skip
                if w8a8_configs:
                    xq, xs = dispatch.quantize_fp8_activation(x)
                    times = {
                        cfg: time_per_call(
                            [
                                lambda q=q, s=s, c=cfg, a=xq, b=xs: triton_fp8_w8a8.linear(
                                    a, b, q, s, config=c
                                )
                                for q, s in qs
                            ]
                        )
                        for cfg in W8A8_DENSE_CONFIGS
                    }
                    best = min(times, key=times.get)
                    print(f"{'':>26} w8a8 codes given: " + " ".join(f"{c}:{v * 1e6:.1f}" for c, v in times.items())
                          + f" | best {best} {times[best] * 1e6:.1f}", flush=True)  # fmt: skip
                print(
                    f"{label:>26} {m:>5} rows: {tb * 1e6:7.1f} | {tk * 1e6:7.1f} | {td * 1e6:7.1f} | {tw * 1e6:7.1f}",
                    flush=True,
                )
                rows.append((label, m, tb, tk, td, tw))
            del ws, qs
    print(f"\n{'metric':<58} {'ours':>9} {'baseline':>9} {'ratio':>6}  device")
    for label, m, tb, tk, td, tw in rows:
        for name, ours in (("kernel", tk), ("dequantized", td), ("w8a8", tw)):
            print(f"{f'{label} us, {m} rows: fp8 {name} / bf16':<58} {ours * 1e6:>9.1f} {tb * 1e6:>9.1f}"
                  f" {tb / ours:>6.2f}  {device}")  # fmt: skip


SWEEP_SHAPES = {"q 4096x2048": (4096, 2048), "k/v 512x2048": (512, 2048), "o 2048x4096": (2048, 4096),
                "gate/up 6144x2048": (6144, 2048), "down 2048x6144": (2048, 6144)}  # fmt: skip
FUSED_SWEEP_SHAPES = {"qkv 5120x2048": (5120, 2048), "o 2048x4096": (2048, 4096),
                      "gate_up 12288x2048": (12288, 2048), "down 2048x6144": (2048, 6144)}  # fmt: skip


def compile_in_parallel(label: str, jobs: list, compile_jobs, *extra) -> None:
    """Warm Triton's cache for a sweep: `compile_jobs(chunk, *extra)` over interleaved chunks of
    `jobs` in spawned processes (one per CPU but two, at most 14)."""
    import multiprocessing as mp
    import os

    procs = max(1, min(14, (os.cpu_count() or 2) - 2))
    t0 = time.time()
    with mp.get_context("spawn").Pool(procs) as pool:
        pool.starmap(compile_jobs, [(jobs[i::procs], *extra) for i in range(procs)])
    print(f"\n{label}: {len(jobs)} variants compiled in {time.time() - t0:.0f} s by {procs} processes")


def sweep_configs(m: int, n: int, k: int) -> list[tuple[tuple[int, int, int, int], int, int]]:
    """((BM, BN, TK, split), num_warps, num_stages) variants of one shape and batch: BN 64 (4 warps,
    3 or 4 stages), 128 (8 warps, 4 stages) or, at >= 32 batch rows, 256 (8 warps, 3 stages); split
    1-16 (>= 1 K tile each, <= ~6 programs per SM); stages at most one more than a split's tiles.
    K tiles of 128 columns, and 256 or 512 (two or four scale blocks per loop step, scales loaded in
    the loop) for BN 64 and, at batches <= 16, for 16- and 32-row weight tiles (1-4 warps, split <= 2)
    that fill the GPU with output tiles rather than K splits. At batches <= 4 also the CUDA-core
    kernel (BM 1, 2 or 4): BN 16-64, 2-8 warps, TK 128-512, split 1-8, 1 or 2 stages."""
    from skyq.rollout.kernels import triton_fp8_gemv as kern

    bm = min(64, max(16, 1 << (m - 1).bit_length()))
    sms = kern.sm_count(torch.device("cuda"))
    families = [(64, (4,), 128, (3, 4), (1, 2, 4, 8, 16)), (128, (8,), 128, (4,), (1, 2, 4, 8, 16)),
                (256, (8,), 128, (3,), (1, 2, 4, 8, 16)), (64, (4,), 256, (2, 3), (1, 2, 4, 8)),
                (64, (4,), 512, (2, 3), (1, 2, 4))]  # fmt: skip
    if bm <= 16:
        families += [(bn, warps, tk, (2, 3, 4), (1, 2)) for bn, warps in ((16, (1, 2)), (32, (2, 4)))
                     for tk in (256, 512)]  # fmt: skip
    out = []
    if m <= 4:  # the CUDA-core kernel (BM = the batch rounded up to 1, 2 or 4; no pipelining or 2 stages)
        bmc = 1 << (m - 1).bit_length()
        for bn in (16, 32, 64):
            for warps in (2, 4, 8):
                if bn * bmc > 16 * warps:  # the [BN, BM, 128] fp32 sums: <= 64 registers a thread
                    continue
                for tk in (128, 256, 512):
                    k_tiles = -(-k // tk)
                    for split in (1, 2, 4, 8):
                        if split > 1 and (-(-k_tiles // split)) * (split - 1) >= k_tiles:
                            continue
                        if -(-n // bn) * split > 8 * sms or -(-n // bn) * split < sms // 2:
                            continue
                        out += [((bmc, bn, tk, split), warps, st) for st in (1, 2)]
    for bn, warp_counts, tk, depths, splits in families:
        if bn > 128 and (bm < 32 or n < 2048):
            continue
        k_tiles = -(-k // tk)
        for split in splits:
            per = -(-k_tiles // split)
            if split > 1 and (per * (split - 1) >= k_tiles or -(-n // bn) * split > 6 * sms):
                continue
            for stages in sorted({min(st, per + 1) for st in depths}):
                if stages * tk * (bn + 2 * bm) > 200 << 10:  # shared memory of the pipeline
                    continue
                out += [((bm, bn, tk, split), warps, max(2, stages)) for warps in warp_counts]
    return out


def _compile_jobs(jobs: list, pdl: bool) -> None:
    """Compile (in a worker process, into Triton's on-disk cache) the kernels that `jobs` launch."""
    from skyq.rollout.kernels import triton_fp8_gemv as kern

    kern.PDL = pdl
    for m, n, k, cfg, warps, stages in jobs:
        x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
        q = torch.zeros(n, k, device="cuda").to(torch.float8_e4m3fn)
        s = torch.ones(-(-n // 128), -(-k // 128), device="cuda")
        try:
            kern.linear(x, q, s, block_size=(128, 128), config=cfg, num_warps=warps, num_stages=stages)
        except Exception as e:  # e.g. out of shared memory: the timing loop skips it too
            print(f"sweep: {m}x{n}x{k} {cfg} {warps} {stages}: {type(e).__name__}", flush=True)
    torch.cuda.synchronize()


def sweep(
    gen: torch.Generator,
    batches: list[int],
    deadline: float,
    log: str | None,
    shapes: dict = SWEEP_SHAPES,
    cc_only: bool = False,
) -> dict:
    """Every `sweep_configs` variant per shape and batch, graphed like per_shape; kernels compiled
    first by a pool of processes. Prints bf16, the default tiling and the best 4 per cell; returns
    {(N, K, M): (config, num_warps, num_stages)} of the best. `cc_only`: the CUDA-core variants only
    (batches <= 4; the cells of larger batches are skipped)."""

    def configs(m: int, n: int, k: int) -> list:
        return [c for c in sweep_configs(m, n, k) if not cc_only or c[0][0] < 16]

    import json

    from skyq.rollout.kernels import triton_fp8_gemv as kern

    cells = [(label, n, k, m) for label, (n, k) in shapes.items() for m in batches]
    jobs = [(m, n, k, *c) for _, n, k, m in cells for c in configs(m, n, k)]
    compile_in_parallel("sweep", jobs, _compile_jobs, kern.PDL)
    print("sweep: us per call (weight-read TB/s); cfg = BN/TK/split/warps/stages")
    out = open(log, "a") if log else None
    best = {}
    for label, n, k in dict.fromkeys((lab, n, k) for lab, n, k, _ in cells):
        ws, qs = rotated(n, k, gen)
        for m in batches:
            if time.time() > deadline:
                print("sweep: out of time")
                return best
            if not configs(m, n, k):
                continue
            x = torch.randn(m, k, generator=gen).to(torch.bfloat16).cuda()
            tb = time_per_call([lambda w=w, x=x: torch.matmul(x, w.T) for w in ws])
            auto = kern.tiling(m, n, k, 128, kern.sm_count(x.device))
            res = []
            for cfg, warps, stages in configs(m, n, k):
                fns = [lambda q=q, s=s, x=x, c=cfg, w=warps, st=stages: kern.linear(
                           x, q, s, block_size=(128, 128), config=c, num_warps=w, num_stages=st)
                       for q, s in qs]  # fmt: skip
                try:
                    res.append((time_per_call(fns), cfg, warps, stages))
                except Exception as e:
                    print(f"sweep: {cfg} {warps} {stages}: {type(e).__name__}: {str(e)[:80]}")
            ta = time_per_call(
                [lambda q=q, s=s, x=x: kern.linear(x, q, s, block_size=(128, 128)) for q, s in qs]
            )
            res.sort()
            best[(n, k, m)] = res[0][1:]
            top = ", ".join(f"{c[1]}/{c[2]}/{c[3]}/{w}/{st} {t * 1e6:.1f}" for t, c, w, st in res[:4])
            print(f"{label} M={m}: bf16 {tb * 1e6:.1f}, auto {auto[1]}/{auto[2]}/{auto[3]} {ta * 1e6:.1f} "
                  f"({n * k / ta / 1e12:.2f} TB/s), best {top}", flush=True)  # fmt: skip
            if out:
                out.write(json.dumps({"n": n, "k": k, "m": m, "bf16": tb, "auto": ta, "res": res}) + "\n")
                out.flush()
        del ws, qs
    return best


def gluon_configs(m: int, n: int, k: int) -> list[tuple[tuple[int, int, int, int, int, int], int]]:
    """((BM, BN, KC, split, warps, kwarps), prefetch) variants of the Gluon kernel for one shape and
    batch: the batch in one tile of BM rows or (above 8 rows) in 2 or 4 tiles, i.e. programs that
    re-read their weights from L2 in exchange for fewer activation registers (then 16 or 32 weight
    rows on one warp, no split); 16 or 32 weight rows a warp (16 on 1 warp, 32 on 1 or 2, 64 on 4);
    1-16 K warp groups (at most 16 warps a program); split 1-4 (at most 2 with K warps), >= 2 steps
    a group; 128-column steps (and 64 at >= 16 rows);
    prefetch 1 (one step) or 3 (one step of codes, activations at their step), and 2 (ping-pong)
    at <= 16 rows. Only variants with >= 100 programs and 2-24 warps per SM."""
    top = min(64, max(8, 1 << (m - 1).bit_length()))
    out = []
    for bm in sorted({top, max(8, top // 2), max(8, top // 4)}, reverse=True):
        for bn, warps in ((16, 1), (32, 1)) if bm < top else ((16, 1), (32, 1), (32, 2), (64, 4)):
            for kw in (1, 2, 4, 8, 16):
                for kc in (64, 128) if bm >= 32 or (bm == 16 and bm == top) else (128,):
                    for sp in (1, 2, 4) if bm == top else (1,):
                        ctas = -(-n // bn) * -(-m // bm) * sp
                        if (
                            warps * kw > 16
                            or -(-k // kc) < 2 * sp * kw
                            or (kw > 1 and sp > 2)
                            or ctas < 100
                            or not 2 * 132 <= ctas * warps * kw <= 24 * 132
                        ):
                            continue
                        pfs = (1, 2, 3) if bm <= 16 else (1, 3)
                        out += [((bm, bn, kc, sp, warps, kw), pf) for pf in pfs]
    return out


def _compile_gluon_jobs(jobs: list) -> None:
    from skyq.rollout.kernels import gluon_fp8_gemv as g
    from skyq.rollout.kernels import triton_fp8_gemv as kern

    for m, n, k, cfg, pf in jobs:
        x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
        q = torch.zeros(n, k, device="cuda").to(torch.float8_e4m3fn)
        s = torch.ones(-(-n // 128), -(-k // 128), device="cuda")
        g.linear(x, q, s, block_size=(128, 128), sms=132, counters=kern._arrival_counters, config=cfg,
                 prefetch=pf)  # fmt: skip
    torch.cuda.synchronize()


TRITON = "triton"
"""A sweep's best that is the Triton kernel (`triton_fp8_gemv._gemv_kernel`, its default tiling)."""


def gluon_sweep(
    gen: torch.Generator, batches: list[int], shapes: dict, deadline: float, log: str | None
) -> dict:
    """Every `gluon_configs` variant per shape and batch, graphed over rotating weight copies; prints
    bf16, the Triton kernel's default, the Gluon default and the best 5; returns {(N, K, M): (config,
    prefetch)} of the best, or TRITON where the Triton kernel was faster. `log`: every timing
    appended there as JSON lines."""
    import json

    from skyq.rollout.kernels import gluon_fp8_gemv as g
    from skyq.rollout.kernels import triton_fp8_gemv as kern

    cells = [(label, n, k, m) for label, (n, k) in shapes.items() for m in batches]
    seen, jobs = set(), []
    for _, n, k, m in cells:
        for cfg, pf in gluon_configs(m, n, k):
            key = (cfg, pf, k % cfg[2] == 0)
            if key not in seen:
                seen.add(key)
                jobs.append((m, n, k, cfg, pf))
    compile_in_parallel("gluon sweep", jobs, _compile_gluon_jobs)
    print("gluon sweep: us per call; cfg = BM/BN/KC/split/warps/kwarps/prefetch")
    sms = kern.sm_count(torch.device("cuda"))
    best = {}
    for label, n, k in dict.fromkeys((lab, n, k) for lab, n, k, _ in cells):
        ws, qs = rotated(n, k, gen)
        for m in batches:
            if time.time() > deadline:
                print("gluon sweep: out of time")
                return best
            x = torch.randn(m, k, generator=gen).to(torch.bfloat16).cuda()
            tb = time_per_call([lambda w=w, x=x: torch.matmul(x, w.T) for w in ws])
            kern.GLUON = False
            tt = time_per_call(
                [lambda q=q, s=s, x=x: kern.linear(x, q, s, block_size=(128, 128)) for q, s in qs]
            )
            kern.GLUON = True
            default = g.tiling(m, n, k, 128, sms)
            td = time_per_call([lambda q=q, s=s, x=x: g.linear(
                x, q, s, block_size=(128, 128), sms=sms, counters=kern._arrival_counters) for q, s in qs])  # fmt: skip
            res = [(tt, TRITON, 0)]
            for cfg, pf in gluon_configs(m, n, k):
                fns = [lambda q=q, s=s, x=x, c=cfg, pf=pf: g.linear(
                           x, q, s, block_size=(128, 128), sms=sms, counters=kern._arrival_counters, config=c,
                           prefetch=pf) for q, s in qs]  # fmt: skip
                res.append((time_per_call(fns), cfg, pf))
            if log:
                with open(log, "a") as f:
                    for t, c, pf in res:
                        f.write(
                            json.dumps(dict(shape=label, m=m, cfg=c, pf=pf, us=t * 1e6, bf16=tb * 1e6)) + "\n"
                        )
            res.sort(key=lambda r: r[0])
            best[(n, k, m)] = TRITON if res[0][1] == TRITON else res[0][1:]
            top = ", ".join(
                "triton" if c == TRITON else f"{c[0]}/{c[1]}/{c[2]}/{c[3]}/{c[4]}/{c[5]}/{pf} {t * 1e6:.1f}"
                for t, c, pf in res[:5]
            )
            print(f"{label} M={m}: bf16 {tb * 1e6:.1f}, triton {tt * 1e6:.1f}, default {default} {td * 1e6:.1f}, best {top}",
                  flush=True)  # fmt: skip
        del ws, qs
    return best


def tuned_gluon(plain, best: dict):
    """`gluon_fp8_gemv.linear` with the variant `best[(N, K, rows)]` where the sweep timed one; a
    TRITON cell runs the Triton kernel instead."""
    from skyq.rollout.kernels import triton_fp8_gemv as kern

    def linear(x, q, s, *, block_size, sms, counters, config=None, prefetch=1):
        hit = best.get((q.shape[0], q.shape[1], x.numel() // x.shape[-1]))
        if hit == TRITON and config is None:
            kern.GLUON = False
            try:
                return kern.linear(x, q, s, block_size=block_size)
            finally:
                kern.GLUON = True
        if hit and config is None and tuple(block_size) == (128, 128):
            config, prefetch = hit
        return plain(
            x, q, s, block_size=block_size, sms=sms, counters=counters, config=config, prefetch=prefetch
        )

    return linear


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 32, 64])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument(
        "--tuned",
        action="store_true",
        help="model, sweep (of the fused shapes with --fused), then model with the sweep's best",
    )
    ap.add_argument("--pdl", action="store_true", help="with --tuned: the model with PDL first")
    ap.add_argument(
        "--profile",
        action="store_true",
        help="per-kernel device time of one graphed step per side and batch (torch.profiler) instead",
    )
    ap.add_argument(
        "--gluon",
        action="store_true",
        help="model with the Triton kernel beside (same run), Gluon sweep, model with the sweep's best",
    )
    ap.add_argument("--cc-only", action="store_true", help="sweep only the CUDA-core kernel (batches <= 4)")
    ap.add_argument(
        "--only",
        choices=[
            "model",
            "per-shape",
            "sweep",
            "gluon-sweep",
            "floor",
            "large",
            "int4",
            "int4-sweep",
            "mxfp8-sweep",
            "mxfp8",
        ],
        default=None,
    )
    ap.add_argument(
        "--tokens", type=int, nargs="+", default=[1, 8, 64, 256], help="--only int4: routed tokens"
    )
    ap.add_argument(
        "--shapes", nargs="+", default=None, metavar="NxK",
        help="sweeps, --only int4 / mxfp8: these weight shapes instead (e.g. small_moe's fused q/k/v and o: 1536x1024 1024x1024)",
    )  # fmt: skip
    ap.add_argument("--fused", action="store_true", help="q/k/v and gate/up as one weight each, both sides")
    ap.add_argument(
        "--scales-in-loop-max-m", type=int, default=None,
        help="batches up to this many rows load the fp8 scales in the K loop "
        "(triton_fp8_gemv.SCALES_IN_LOOP_MAX_M; default: the module's)",
    )  # fmt: skip
    ap.add_argument("--sweep-seconds", type=float, default=1e9, help="stop sweeping after this long")
    ap.add_argument("--sweep-log", default=None, help="append the sweep's timings here, JSON lines")
    ap.add_argument(
        "--w8a8-configs", action="store_true", help="with --only large: each of W8A8_DENSE_CONFIGS too"
    )
    args = ap.parse_args()
    if args.scales_in_loop_max_m is not None:
        from skyq.rollout.kernels import triton_fp8_gemv

        triton_fp8_gemv.SCALES_IN_LOOP_MAX_M = args.scales_in_loop_max_m
    gen = torch.Generator().manual_seed(0)
    device = torch.cuda.get_device_name()
    print(f"device {device}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}")
    print(f"copy bandwidth (read+write) {copy_bandwidth() / 1e12:.2f} TB/s")
    deadline = time.time() + args.sweep_seconds
    if args.only == "per-shape":
        per_shape(gen, args.batches)
        return
    if args.only == "floor":
        per_call_floor(gen)
        return
    if args.only == "large":
        large(gen, args.batches, args.w8a8_configs)
        return
    custom = {s: tuple(int(d) for d in s.split("x")) for s in args.shapes or ()}
    if args.only in ("int4", "mxfp8", "int4-sweep", "mxfp8-sweep"):  # the weight-only formats' benchmarks
        from decode_wo import int4_decode, mxfp8_dense, wo_gluon_sweep
    if args.only == "mxfp8":
        mxfp8_dense(gen, args.batches, custom or FUSED_SWEEP_SHAPES)
        return
    if args.only == "int4":
        int4_decode(gen, args.batches, args.tokens, custom or FUSED_SWEEP_SHAPES)
        return
    if args.only in ("int4-sweep", "mxfp8-sweep"):
        wo_gluon_sweep(gen, args.batches, args.tokens, args.sweep_log, mx=args.only == "mxfp8-sweep")
        return
    if args.only in ("sweep", "gluon-sweep"):
        shapes = custom or (FUSED_SWEEP_SHAPES if args.fused else SWEEP_SHAPES)
        if args.only == "sweep":
            sweep(gen, args.batches, deadline, args.sweep_log, shapes, args.cc_only)
        else:
            gluon_sweep(gen, args.batches, shapes, deadline, args.sweep_log)
        return
    layers = make_layers(args.layers, gen, args.fused)
    fp8 = [{name: dispatch.quantize_fp8_blockwise(w) for name, w in layer.items()} for layer in layers]
    n_params = sum(w.numel() for layer in layers for w in layer.values())
    print(f"dense Qwen3-30B-A3B-active-shaped stack: {args.layers} layers, {n_params / 1e6:.0f}M params"
          + (", q/k/v and gate/up fused" if args.fused else ""))  # fmt: skip

    def bf16_linear(x, w):
        return F.linear(x, w)

    by_id = {id(w): fp8[i][name] for i, layer in enumerate(layers) for name, w in layer.items()}

    def fp8_linear(x, w):
        q, s = by_id[id(w)]
        return fp8_linear.fp8_weight_only_linear(x, q, s)

    def run_model(label: str, triton_beside: bool = False) -> list[tuple]:
        """bf16 vs fp8 per batch; `triton_beside`: also the fp8 model on the Triton kernel
        (`triton_fp8_gemv.GLUON = False` while its graph is captured), interleaved with both."""
        rows, beside = [], []
        for m in args.batches:
            x = torch.randn(m, HIDDEN, generator=gen).to(torch.bfloat16).cuda()
            y_b, y_f = step(x, layers, bf16_linear), step(x, layers, fp8_linear)
            rel = float((y_f.float() - y_b.float()).norm() / y_b.float().norm())
            gb = graphed(lambda t: step(t, layers, bf16_linear), x)
            gf = graphed(lambda t: step(t, layers, fp8_linear), x)
            gt = None
            if triton_beside:
                kern.GLUON = False
                gt = graphed(lambda t: step(t, layers, fp8_linear), x)
                kern.GLUON = True
            tb, tf, tt = [], [], []
            for _ in range(args.repeats):  # interleaved so drift hits all sides alike
                tb += time_graph(gb, args.replays, 1)
                tf += time_graph(gf, args.replays, 1)
                if gt is not None:
                    tt += time_graph(gt, args.replays, 1)
            mb, mf = statistics.median(tb), statistics.median(tf)
            rows.append((m, m / mb, m / mf, mb, mf, min(tb), max(tb), min(tf), max(tf), rel))
            if gt is not None:
                beside.append((m, mb, statistics.median(tt), mf))
            del gb, gf, gt
        print(
            f"\n{label}\nbatch  bf16 step us [min-max]     fp8 step us [min-max]   fp8 weight GB/s  rel.diff vs bf16"
        )
        fp8_bytes = n_params  # one byte per weight (+ scales, 1/4096 of that)
        for m, _, _, mb, mf, b0, b1, f0, f1, rel in rows:
            print(f"{m:>5}  {mb * 1e6:8.1f} [{b0 * 1e6:.1f}-{b1 * 1e6:.1f}]   {mf * 1e6:8.1f} [{f0 * 1e6:.1f}-{f1 * 1e6:.1f}]"
                  f"   {fp8_bytes / mf / 1e9:8.0f}   {rel:.2e}")  # fmt: skip
        if beside:
            print("\nsame run: fp8 on the Triton kernel (GLUON off) vs the default (Gluon where it applies)")
            print("batch  bf16 us  triton us  gluon us  triton/bf16  gluon/bf16 (tokens/s ratios)")
            for m, mb, mt, mf in beside:
                print(
                    f"{m:>5}  {mb * 1e6:7.1f}  {mt * 1e6:9.1f}  {mf * 1e6:8.1f}  {mb / mt:11.2f}  {mb / mf:10.2f}"
                )
        table(rows, device)  # printed before the diagnostics too, in case a time limit cuts them
        return rows

    from skyq.rollout.kernels import triton_fp8_gemv as kern

    if args.profile:
        profile_step(layers, bf16_linear, fp8_linear, args.batches, gen)
        return
    if args.tuned and args.pdl:
        kern.PDL, pdl = True, kern.PDL
        try:
            run_model("the default tiling with programmatic dependent launch")
        except Exception as e:
            print(f"\nfp8 run with programmatic dependent launch failed: {type(e).__name__}: {e}")
        kern.PDL = pdl
    if args.gluon:
        rows = run_model("fp8: the default (the Gluon kernel, gluon_fp8_gemv.tiling)", triton_beside=True)
        if args.no_sweep:
            return
        shapes = FUSED_SWEEP_SHAPES if args.fused else SWEEP_SHAPES
        best = gluon_sweep(gen, args.batches, shapes, deadline, args.sweep_log)
        from skyq.rollout.kernels import gluon_fp8_gemv as g

        g.linear, plain, max_m = tuned_gluon(g.linear, best), g.linear, kern.GLUON_MAX_M
        kern.GLUON_MAX_M = 64  # every batch through the tuned wrapper (which may pick the Triton kernel)
        run_model("fp8: the sweep's best per shape and batch (Gluon variants or the Triton kernel)")
        g.linear, kern.GLUON_MAX_M = plain, max_m
        print("\nthe default, again:")
        table(rows, device)
        return
    rows = run_model("fp8: the default dispatch (Gluon at <= 16 rows, triton_fp8_gemv.tiling above)")
    if args.tuned:  # the sweep's best variant per projection shape and batch, then the model again
        shapes = FUSED_SWEEP_SHAPES if args.fused else SWEEP_SHAPES
        best = sweep(gen, args.batches, deadline, args.sweep_log, shapes, args.cc_only)
        kern.linear = tuned_linear(kern.linear, best)
        run_model("fp8 kernel tiling: the sweep's best per shape and batch")
        print("\nthe default tiling, again:")
        table(rows, device)
    elif not args.no_sweep and args.only is None:
        per_shape(gen, args.batches)
        sweep(gen, args.batches, deadline, args.sweep_log)
        table(rows, device)


def profile_step(
    layers: list[dict], bf16_linear, fp8_linear, batches: list[int], gen: torch.Generator
) -> None:
    """Where a graphed decode step's time goes: per kernel name, device microseconds per step and
    launches per step (torch.profiler over 10 replays), their sum against the step's wall time; the
    rest is the gaps between kernels."""
    for m in batches:
        x = torch.randn(m, HIDDEN, generator=gen).to(torch.bfloat16).cuda()
        for side, linear in (("bf16", bf16_linear), ("fp8", fp8_linear)):
            g = graphed(lambda t, lin=linear: step(t, layers, lin), x)
            wall = statistics.median(time_graph(g, 20, 5))
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(10):
                    g.replay()
                torch.cuda.synchronize()
            rows = [
                (e.device_time_total / 10, e.count / 10, e.key)
                for e in prof.key_averages()
                if e.device_time_total > 0
            ]
            rows.sort(reverse=True)
            busy = sum(r[0] for r in rows)
            print(f"\nbatch {m} {side}: step {wall * 1e6:.1f} us, kernels {busy:.1f} us ({busy / (wall * 1e6):.0%}), "
                  f"{sum(r[1] for r in rows):.0f} launches")  # fmt: skip
            for us, count, key in rows[:8]:
                print(f"  {us:8.1f} us  {count:5.0f} x  {us / max(count, 1):6.2f} us each  {key[:90]}")
            del g


def tuned_linear(plain, best: dict):
    """`triton_fp8_gemv.linear` with the variant `best[(N, K, rows)]` where the sweep timed one."""

    def linear(x, q, s, *, block_size, config=None, num_warps=None, num_stages=None):
        hit = best.get((q.shape[0], q.shape[1], x.numel() // x.shape[-1]))
        if hit and config is None and tuple(block_size) == (128, 128):
            config, num_warps, num_stages = hit
        return plain(
            x, q, s, block_size=block_size, config=config, num_warps=num_warps, num_stages=num_stages
        )

    return linear


def table(rows: list[tuple], device: str) -> None:
    print("\nmetric                       ours (fp8)   baseline (bf16)  ratio  device")
    for m, tok_b, tok_f, *_ in rows:
        print(
            f"M4 decode tok/s batch {m:<3}   {tok_f:10.0f}   {tok_b:14.0f}  {tok_f / tok_b:5.2f}  {device}",
            flush=True,
        )


if __name__ == "__main__":
    main()
