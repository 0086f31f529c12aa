"""The engine's routed-experts block at decode sizes on a GPU, same run: bf16 and FP8 experts in the
per-expert loop (cuBLAS; one weight-only kernel a routed expert and projection), and both stacked
(`WireExperts.stack`: three grouped launches, no host sync; bf16 through `torch._grouped_mm`, FP8
through the grouped Gluon kernel).

Shapes: one Qwen3-30B-A3B MoE layer (hidden 2048, 128 experts of intermediate 768, top-8): 604M
expert parameters (1.2 GB bf16, 0.6 GB fp8), far beyond the 50 MB L2. Tokens are routed uniformly
at random (top-8 distinct experts a token), so at 16+ tokens most experts have rows, as in real
decode. Times are wall-clock per call after a sync (the loop syncs with the host to find the
routed experts; the grouped path does not, so it is also shown replayed from a CUDA graph).

    python benchmarks/moe_decode.py [--tokens 1 4 16 64] [--repeats 20]

`--sweep` times the grouped FP8 kernel alone (`gluon_fp8_gemv.linear_grouped`) at its default tiling
and each of SWEEP_CONFIGS beside bf16's `torch._grouped_mm` on the same routed rows, per projection (the stacked
gate+up, down), graphed over `--layers` copies of the weights in turn (the decode step reads each
layer's experts once, so L2 holds none of them), for a model's expert shape:

    python benchmarks/moe_decode.py --sweep [--shape a3b|small_moe] [--tokens 1 8 16 32 64]

`--large` times the paths of a large decode step (more tokens than `DECODE_MAX_ROWS`), per projection,
graphed over `--layers` weight copies like the sweep: bf16's `torch._grouped_mm`, the grouped FP8 kernel
at its default tiling, each FP8 stack dequantized then `torch._grouped_mm` (what every step above
64 tokens did before large decode steps kept the decode path), and the FP8 x FP8 kernel
(`triton_fp8_w8a8`) with the routed rows'
activation quantization (1 x 128 codes) in the call and without it, for both model shapes;
`--w8a8-configs` also times each of W8A8_CONFIGS (codes quantized beforehand):

    python benchmarks/moe_decode.py --large [--tokens 64 128 256 512 1024] [--w8a8-configs]

`--routing` times the routing of the rows alone (`moe_route.route`, one launch forced vs what it picks vs
the torch reference), graphed:

    python benchmarks/moe_decode.py --routing --tokens 64 128 512 1024
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from skyq.config.enums import Precision
from skyq.config.schema import PrecisionConfig
from skyq.quant.layouts import Role
from skyq.quant.strategies import get_strategy
from skyq.rollout.kernels import fp8_linear
from skyq.rollout.quantized_linear import ExpertMLP, WireExperts, WireLinear

HIDDEN, INTER, EXPERTS, TOP_K = 2048, 768, 128, 8
SHAPES = {"gate_proj": (INTER, HIDDEN), "up_proj": (INTER, HIDDEN), "down_proj": (HIDDEN, INTER)}


def build(gen: torch.Generator) -> tuple[WireExperts, WireExperts]:
    """(bf16 experts, fp8 experts) of the same random weights, on the GPU."""
    strategy = get_strategy(PrecisionConfig(name=Precision.fp8_blockwise))
    bf16, fp8 = [], []
    for e in range(EXPERTS):
        plain, wired = {}, {}
        for proj, shape in SHAPES.items():
            name = f"model.layers.0.mlp.experts.{e}.{proj}.weight"
            w = torch.randn(shape, generator=gen) * 0.02
            lin = nn.Linear(shape[1], shape[0], bias=False, dtype=torch.bfloat16, device="cuda")
            lin.weight.data.copy_(w)
            plain[proj] = lin.requires_grad_(False)
            wl = WireLinear(name, Role.routed_expert, strategy.wire_specs(name, shape, Role.routed_expert), strategy,
                            activation=None).cuda()  # fmt: skip
            for wire_name, t in strategy.serialize(name, w.cuda(), role=Role.routed_expert).items():
                wl.get_buffer(wire_name.removeprefix(wl.stem)).copy_(t)
            wired[proj] = wl
        bf16.append(ExpertMLP(*plain.values(), act_fn=F.silu))
        fp8.append(ExpertMLP(*wired.values(), act_fn=F.silu))
    return WireExperts(bf16), WireExperts(fp8)


def wall(fn, repeats: int) -> float:
    """Median seconds per call, synchronized around each."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def graphed(fn, repeats: int) -> float:
    """Median seconds per replay of a CUDA graph of fn (no host work)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return wall(g.replay, repeats)


SWEEP_SHAPES = {  # (hidden, expert width, experts, top-k)
    "a3b": (HIDDEN, INTER, EXPERTS, TOP_K),
    "small_moe": (1024, 768, 32, 4),
}
SWEEP_CONFIGS = [  # (BM, warps, kwarps); BN = 16 weight rows a warp, KC = 128
    (8, 1, 1), (8, 1, 2), (8, 1, 4), (8, 1, 8), (16, 1, 1), (16, 1, 2), (16, 1, 4), (16, 1, 8),
    (8, 2, 1), (8, 2, 2), (16, 2, 1), (16, 2, 2), (32, 1, 1), (32, 1, 2),
]  # fmt: skip


def routed(tokens: int, experts: int, top_k: int, gen: torch.Generator) -> Tensor:
    """int32 offsets [E + 1] of `tokens` tokens routed to top_k distinct uniform experts each."""
    idx = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    counts = torch.bincount(idx.flatten(), minlength=experts)
    return torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)]).to(torch.int32).cuda()


def graphed_calls(fns, repeats: int) -> float:
    """Median seconds per call of a CUDA graph replaying every fn of `fns` once, in turn."""
    return graphed(lambda: [fn() for fn in fns], repeats) / len(fns)


def sweep(args, gen: torch.Generator) -> None:
    from skyq.ops.grouped_mm import bf16_grouped_linear
    from skyq.quant import fp8_blockwise
    from skyq.rollout.kernels import gluon_fp8_gemv
    from skyq.rollout.kernels.triton_fp8_gemv import sm_count

    hidden, inter, experts, top_k = SWEEP_SHAPES[args.shape]
    sms = sm_count(torch.device("cuda"))
    print(f"{args.shape}: {experts} experts x (gate+up {2 * inter}x{hidden}, down {hidden}x{inter}), top-{top_k}, "
          f"{args.layers} weight copies in turn; us a call, graphed")  # fmt: skip
    rows = []
    for proj, (n, k) in {"gate_up": (2 * inter, hidden), "down": (hidden, inter)}.items():
        ws, qs = _stacks(experts, n, k, args.layers)
        for t in args.tokens:
            offs = routed(t, experts, top_k, gen)
            x = torch.randn(t * top_k, k, generator=gen).to(torch.bfloat16).cuda()
            with torch.inference_mode():
                tb = graphed_calls(
                    [functools.partial(bf16_grouped_linear, x, w, offs) for w in ws], args.repeats
                )
                default = gluon_fp8_gemv.grouped_tiling(t * top_k, experts, n, k, 128, sms)
                ref = bf16_grouped_linear(x, fp8_blockwise.dequantize(*qs[0]), offs).float()
                best = None
                line = []
                for bm, warps, kw in [tuple(default[i] for i in (0, 4, 5))] + SWEEP_CONFIGS:
                    cfg = (bm, 16 * warps, 128, 1, warps, kw)
                    out = gluon_fp8_gemv.linear_grouped(
                        x, *qs[0], offs, block_size=(128, 128), sms=sms, config=cfg
                    )
                    err = float((out.float() - ref).norm() / ref.norm())
                    if not err < 1e-2:
                        raise AssertionError(f"{proj} {t} tokens config {cfg}: relative error {err:.2e}")
                    tf = graphed_calls(
                        [functools.partial(gluon_fp8_gemv.linear_grouped, x, *q, offs, block_size=(128, 128),
                                           sms=sms, config=cfg) for q in qs],
                        args.repeats,
                    )  # fmt: skip
                    line.append(f"{bm}/{warps}/{kw} {tf * 1e6:.1f}")
                    if best is None or tf < best[0]:
                        best = (tf, (bm, warps, kw))
                    if len(line) == 1:
                        tdef = tf
            print(f"{proj} {t:>3} tok: bf16 {tb * 1e6:.1f} | default " + " | ".join(line), flush=True)
            rows.append((proj, t, tb, tdef, best))
    device = torch.cuda.get_device_name()
    print(f"\n{'metric':<58} {'ours':>9} {'baseline':>9} {'ratio':>6}  device")
    for proj, t, tb, tdef, (tbest, cfg) in rows:
        print(f"{f'{args.shape} {proj} us, {t} tok: fp8 default / bf16':<58} {tdef * 1e6:>9.1f} {tb * 1e6:>9.1f}"
              f" {tb / tdef:>6.2f}  {device}")  # fmt: skip
        print(f"{f'{args.shape} {proj} us, {t} tok: fp8 best {cfg} / bf16':<58} {tbest * 1e6:>9.1f} "
              f"{tb * 1e6:>9.1f} {tb / tbest:>6.2f}  {device}")  # fmt: skip


def _stacks(experts: int, n: int, k: int, layers: int) -> tuple[list[Tensor], list[tuple[Tensor, Tensor]]]:
    """`layers` random bf16 [E, N, K] expert stacks on the GPU and their FP8 blockwise quantization."""
    from skyq.quant import fp8_blockwise

    cuda_gen = torch.Generator(device="cuda").manual_seed(1)
    ws = [
        (torch.randn(experts, n, k, generator=cuda_gen, device="cuda") * 0.02).to(torch.bfloat16)
        for _ in range(layers)
    ]
    return ws, [fp8_blockwise.quantize(w) for w in ws]


W8A8_CONFIGS = [  # (BM, BN, MT, warps, stages) of triton_fp8_w8a8
    (16, 128, 1, 4, 3), (32, 128, 1, 4, 3), (64, 128, 1, 4, 3), (64, 128, 1, 8, 3), (128, 128, 1, 8, 3),
    (32, 64, 1, 4, 3), (64, 64, 1, 4, 3), (64, 128, 1, 4, 4), (64, 128, 2, 4, 3), (128, 128, 1, 8, 4),
]  # fmt: skip


def large(args, gen: torch.Generator) -> None:
    from skyq.ops.grouped_mm import bf16_grouped_linear
    from skyq.quant.kernels import dispatch
    from skyq.rollout.kernels import gluon_fp8_gemv, triton_fp8_w8a8
    from skyq.rollout.kernels.triton_fp8_gemv import sm_count

    def w8a8(x, q, s, offs):
        return fp8_linear.fp8_grouped_w8a8_linear(*dispatch.quantize_fp8_activation(x), q, s, offs)

    sms = sm_count(torch.device("cuda"))
    device = torch.cuda.get_device_name()

    def dequantized(x, q, s, offs):
        return bf16_grouped_linear(x, dispatch.dequantize_fp8_blockwise(q, s), offs)

    print(f"{args.layers} weight copies in turn; us a call, graphed")
    rows = []
    with torch.inference_mode(), dispatch.deferred_finite_checks(max_pending=1 << 30):
        for shape in ("small_moe", "a3b"):
            hidden, inter, experts, top_k = SWEEP_SHAPES[shape]
            for proj, (n, k) in {"gate_up": (2 * inter, hidden), "down": (hidden, inter)}.items():
                ws, qs = _stacks(experts, n, k, args.layers)
                for t in args.tokens:
                    offs = routed(t, experts, top_k, gen)
                    x = torch.randn(t * top_k, k, generator=gen).to(torch.bfloat16).cuda()
                    tb = graphed_calls(
                        [functools.partial(bf16_grouped_linear, x, w, offs) for w in ws], args.repeats
                    )
                    tk = graphed_calls(
                        [functools.partial(gluon_fp8_gemv.linear_grouped, x, *q, offs, block_size=(128, 128), sms=sms)
                         for q in qs], args.repeats,
                    )  # fmt: skip
                    td = graphed_calls(
                        [functools.partial(dequantized, x, *q, offs) for q in qs], args.repeats
                    )
                    tw = graphed_calls([functools.partial(w8a8, x, *q, offs) for q in qs], args.repeats)
                    xq, xs = dispatch.quantize_fp8_activation(x)
                    # the weight-only path's value on the fake-quantized rows (the engine's W8A8 input)
                    ref = dequantized(
                        dispatch.fake_quant_fp8_blockwise(x, block_size=(1, 128)), *qs[0], offs
                    ).float()
                    err = float((w8a8(x, *qs[0], offs).float() - ref).norm() / ref.norm())
                    if not err < 1e-2:
                        raise AssertionError(f"{shape} {proj} {t} tokens: w8a8 relative error {err:.2e}")
                    tw0 = graphed_calls(
                        [functools.partial(fp8_linear.fp8_grouped_w8a8_linear, xq, xs, *q, offs) for q in qs],
                        args.repeats,
                    )
                    sweep_line = ""
                    if args.w8a8_configs:
                        times = {
                            cfg: graphed_calls(
                                [
                                    functools.partial(
                                        triton_fp8_w8a8.linear_grouped, xq, xs, *q, offs, config=cfg
                                    )
                                    for q in qs
                                ],
                                args.repeats,
                            )  # fmt: skip
                            for cfg in W8A8_CONFIGS
                        }
                        best = min(times, key=times.get)
                        sweep_line = " | " + " ".join(f"{c}:{v * 1e6:.1f}" for c, v in times.items())
                        sweep_line += f" | best {best} {times[best] * 1e6:.1f}"
                    bm = gluon_fp8_gemv.grouped_tiling(t * top_k, experts, n, k, 128, sms)[0]
                    print(f"{shape} {proj} {t:>5} tok ({t * top_k / experts:.0f} rows an expert, BM {bm}): bf16 "
                          f"{tb * 1e6:.1f} | fp8 kernel {tk * 1e6:.1f} | fp8 dequantized {td * 1e6:.1f} | w8a8 "
                          f"{tw * 1e6:.1f} (codes given {tw0 * 1e6:.1f}, err {err:.1e}){sweep_line}", flush=True)  # fmt: skip
                    rows.append((shape, proj, t, tb, tk, td, tw))
                del ws, qs
    print(f"\n{'metric':<58} {'ours':>9} {'baseline':>9} {'ratio':>6}  device")
    for shape, proj, t, tb, tk, td, tw in rows:
        for label, ours, base in (
            (f"{shape} {proj} us, {t} tok: fp8 kernel / bf16", tk, tb),
            (f"{shape} {proj} us, {t} tok: fp8 kernel / fp8 dequantized", tk, td),
            (f"{shape} {proj} us, {t} tok: fp8 w8a8 (+ act quant) / bf16", tw, tb),
        ):
            print(f"{label:<58} {ours * 1e6:>9.1f} {base * 1e6:>9.1f} {base / ours:>6.2f}  {device}")


def routing_times(args, gen: torch.Generator) -> None:
    """The routing of a decode step's rows (`moe_route.route`) per layer, graphed: the one-launch
    kernel and the two block-counting launches (each forced at every size), what `route` picks
    (`ONE_LAUNCH_MAX_ENTRIES`) and the torch reference, over 128 experts, top-8."""
    from skyq.ops import moe_route

    device = torch.cuda.get_device_name()
    rows = []
    for t in args.tokens:
        idx = torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOP_K] for _ in range(t)]).cuda()
        want = moe_route.route_reference(idx, EXPERTS)
        assert all(torch.equal(a, b) for a, b in zip(moe_route.route(idx, EXPERTS), want, strict=True))
        limit = moe_route.ONE_LAUNCH_MAX_ENTRIES
        forced = {}
        try:
            for label, value in (("one", 1 << 30), ("two", 0)):
                moe_route.ONE_LAUNCH_MAX_ENTRIES = value
                forced[label] = graphed(lambda i=idx: moe_route.route(i, EXPERTS), args.repeats)
        finally:
            moe_route.ONE_LAUNCH_MAX_ENTRIES = limit
        one = forced["one"]
        picked = graphed(lambda i=idx: moe_route.route(i, EXPERTS), args.repeats)
        ref = graphed(lambda i=idx: moe_route.route_reference(i, EXPERTS), args.repeats)
        print(f"{t:>5} tokens ({t * TOP_K} rows): one launch {one * 1e6:.1f} | two launches {forced['two'] * 1e6:.1f} "
              f"| route {picked * 1e6:.1f} | reference {ref * 1e6:.1f} us", flush=True)  # fmt: skip
        rows.append((t, one, picked, ref))
    print(f"\n{'metric':<58} {'ours':>9} {'baseline':>9} {'ratio':>6}  device")
    for t, one, picked, ref in rows:
        for label, base in (("one launch", one), ("reference", ref)):
            print(f"{f'routing us, {t} tok x top-8: route / {label}':<58} {picked * 1e6:>9.1f} {base * 1e6:>9.1f}"
                  f" {base / picked:>6.2f}  {device}")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--sweep", action="store_true", help="the grouped FP8 kernel's tilings alone (see above)")
    ap.add_argument("--shape", choices=sorted(SWEEP_SHAPES), default="a3b")
    ap.add_argument("--layers", type=int, default=4, help="weight copies a sweep rotates through")
    ap.add_argument("--large", action="store_true", help="the paths of a large decode step (see above)")
    ap.add_argument("--w8a8-configs", action="store_true", help="with --large: each of W8A8_CONFIGS too")
    ap.add_argument(
        "--routing", action="store_true", help="the routing of the rows alone (see routing_times)"
    )
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    if args.routing:
        return routing_times(args, gen)
    if args.large:
        print(
            f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}"
        )
        return large(args, gen)
    if args.sweep:
        print(
            f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}"
        )
        return sweep(args, gen)
    device = torch.cuda.get_device_name()
    print(f"device {device}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}")
    bf16, fp8 = build(gen)
    stacked, bf16_stacked = WireExperts(list(fp8)), WireExperts(list(bf16))
    assert stacked.stack() and bf16_stacked.stack(), "the experts did not stack"
    print(f"{EXPERTS} experts x (gate, up {INTER}x{HIDDEN}, down {HIDDEN}x{INTER}), top-{TOP_K}")
    print(f"{'tokens':>6} {'bf16 loop':>10} {'fp8 loop':>10} {'bf16 grouped':>13} {'fp8 grouped':>12}"
          f" {'bf16 grp graph':>15} {'fp8 grp graph':>14} {'fp8 grp vs loop':>16}  (us a call)")  # fmt: skip
    rows = []
    for t in args.tokens:
        x = torch.randn(t, HIDDEN, generator=gen).to(torch.bfloat16).cuda()
        idx = torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOP_K] for _ in range(t)]).cuda()
        wts = torch.softmax(torch.randn(t, TOP_K, generator=gen), -1).to(torch.bfloat16).cuda()
        inputs = (x, idx, wts)
        with torch.inference_mode():
            tb = wall(lambda a=inputs: bf16(*a), args.repeats)
            tl = wall(lambda a=inputs: fp8(*a), args.repeats)  # the same modules, not stacked: the loop
            tbg = wall(lambda a=inputs: bf16_stacked(*a), args.repeats)
            tg = wall(lambda a=inputs: stacked(*a), args.repeats)
            tbgg = graphed(lambda a=inputs: bf16_stacked(*a), args.repeats)
            tgg = graphed(lambda a=inputs: stacked(*a), args.repeats)
            loop, grouped = fp8(*inputs).float(), stacked(*inputs).float()
        rel = float((grouped - loop).norm() / loop.norm())
        print(f"{t:>6} {tb * 1e6:>10.1f} {tl * 1e6:>10.1f} {tbg * 1e6:>13.1f} {tg * 1e6:>12.1f} {tbgg * 1e6:>15.1f}"
              f" {tgg * 1e6:>14.1f} {rel:>16.2e}", flush=True)  # fmt: skip
        rows.append((t, tb, tg, tgg, tbg, tbgg))
    print(f"\n{'metric':<58} {'ours':>9} {'baseline':>9} {'ratio':>6}  device")
    for t, tb, tg, tgg, tbg, tbgg in rows:
        for label, ours, base in (
            (f"MoE experts us, {t} tok: fp8 grouped / bf16 grouped, graph", tgg, tbgg),
            (f"MoE experts us, {t} tok: fp8 grouped / bf16 grouped, eager", tg, tbg),
            (f"MoE experts us, {t} tok: fp8 grouped / bf16 loop (before)", tg, tb),
        ):
            print(f"{label:<58} {ours * 1e6:>9.1f} {base * 1e6:>9.1f} {base / ours:>6.2f}  {device}")


if __name__ == "__main__":
    main()
