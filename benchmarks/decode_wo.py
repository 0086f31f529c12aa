"""The weight-only decode benchmarks of INT4 (W4A16) and MXFP8 (W8A16) linears, run through
`benchmarks/decode.py --only int4 / mxfp8 / int4-sweep / mxfp8-sweep` (split out of decode.py, whose
graphing and timing helpers they use): per call, dense and grouped over MoE experts, bf16 beside
the kernels; and the Gluon weight-only kernel's tiling sweeps."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from decode import (  # benchmarks/ on the path
    FUSED_SWEEP_SHAPES,
    compile_in_parallel,
    gluon_configs,
    time_per_call,
)

from skyq.quant.kernels import dispatch
from skyq.rollout.kernels import int4_mxfp8_linear


def routed_rows(
    gen: torch.Generator, tokens: int, experts: int, top_k: int, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(bf16 rows [tokens * top_k, k] sorted by expert, int32 offsets [experts + 1]) on the GPU, each
    token routed to top_k distinct random experts."""
    chosen = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    counts = torch.bincount(chosen.flatten(), minlength=experts)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)]).to(torch.int32).cuda()
    return torch.randn(tokens * top_k, k, generator=gen).to(torch.bfloat16).cuda(), offsets


INT4_GROUP = 32
"""`--only int4`: the INT4 recipe's default group size (`precision.int4_group_size`)."""

INT4_EXPERT_SHAPES = {"a3b": (128, 2048, 768, 8), "small_moe": (32, 1024, 768, 4)}
"""`--only int4`: (experts, hidden, intermediate, top-k) of the grouped experts timed."""


def int4_decode(
    gen: torch.Generator, batches: list[int], tokens: list[int], shapes: dict[str, tuple[int, int]]
) -> None:
    """INT4 W4A16 decode, graphed over rotating weight copies, us a call: each fused dense shape at
    `batches` rows (bf16 `torch.matmul`; `triton_int4_gemv.linear`'s default, the Gluon kernel on
    sm_90; the Triton kernel, `GLUON` off; the weight dequantized by the Triton kernel then
    `F.linear`), then the grouped experts of both model shapes at `tokens` tokens routed top-k (bf16
    `torch._grouped_mm` on the stack; the default; the Triton kernel), per projection (gate, of the
    intermediate's rows, and down)."""
    from skyq.ops.grouped_mm import bf16_grouped_linear
    from skyq.quant.kernels import triton_int4
    from skyq.rollout.kernels import triton_int4_gemv

    g = INT4_GROUP
    device = torch.cuda.get_device_name()
    rows = []

    def both(fns) -> tuple[float, float]:
        """(default, Triton kernel) seconds a call."""
        out = []
        for gluon in (True, False):
            triton_int4_gemv.GLUON = gluon
            out.append(time_per_call(fns))
        triton_int4_gemv.GLUON = True
        return out[0], out[1]

    def dequantized(x, p, s):
        n, k = p.shape[0], p.shape[1] * 8
        return F.linear(x, triton_int4.dequantize_packed(p, s, n, k, g, torch.bfloat16))

    print(
        "\nINT4 dense, us a call: bf16 | int4 default (Gluon on sm_90) | Triton kernel | dequantize + F.linear"
    )
    with torch.inference_mode():
        for label, (n, k) in shapes.items():
            copies = max(1, min(64, (256 << 20) // (n * k)))
            w = (torch.randn(n, k, generator=gen) * 0.02).to(torch.bfloat16).cuda()
            ws = [w.clone() for _ in range(copies)]
            ps = [dispatch.quantize_int4_packed(wi, group_size=g) for wi in ws]
            for m in batches:
                x = torch.randn(m, k, generator=gen).to(torch.bfloat16).cuda()
                tb = time_per_call([functools.partial(torch.matmul, x, wi.T) for wi in ws])
                tk, tt = both(
                    [functools.partial(triton_int4_gemv.linear, x, p, s, group_size=g) for p, s in ps]
                )
                td = time_per_call([functools.partial(dequantized, x, p, s) for p, s in ps])
                print(f"{label:>20} {m:>3} rows: {tb * 1e6:6.1f} | {tk * 1e6:6.1f} | {tt * 1e6:6.1f} | "
                      f"{td * 1e6:6.1f}", flush=True)  # fmt: skip
                rows.append((f"{label} us, {m} rows: int4 / bf16", tk, tb))
                rows.append((f"{label} us, {m} rows: int4 Triton kernel / bf16", tt, tb))
                rows.append((f"{label} us, {m} rows: dequantize + linear / bf16", td, tb))
        print("\nINT4 grouped experts, us a call: bf16 grouped GEMM | int4 default | Triton kernel")
        for shape, (experts, hidden, inter, top_k) in INT4_EXPERT_SHAPES.items():
            for proj, (n, k) in (("gate", (inter, hidden)), ("down", (hidden, inter))):
                wb = (torch.randn(experts, n, k, generator=gen) * 0.02).to(torch.bfloat16).cuda()
                packed, scale = dispatch.quantize_int4_packed(wb, group_size=g)
                for t in tokens:
                    x, offsets = routed_rows(gen, t, experts, top_k, k)
                    tb = time_per_call([functools.partial(bf16_grouped_linear, x, wb, offsets)] * 8)
                    grouped = functools.partial(
                        triton_int4_gemv.linear_grouped, x, packed, scale, offsets, group_size=g
                    )
                    tk, tt = both([grouped] * 8)
                    print(
                        f"{shape:>10} {proj:>5} {t:>4} tokens: {tb * 1e6:6.1f} | {tk * 1e6:6.1f} | {tt * 1e6:6.1f}",
                        flush=True,
                    )
                    rows.append((f"{shape} {proj} us, {t} tokens: int4 grouped / bf16", tk, tb))
                    rows.append((f"{shape} {proj} us, {t} tokens: int4 Triton grouped / bf16", tt, tb))
    print(f"\n{'metric':<62} {'ours':>9} {'baseline':>9} {'ratio':>6}  device")
    for label, ours, base in rows:
        print(f"{label:<62} {ours * 1e6:>9.1f} {base * 1e6:>9.1f} {base / ours:>6.2f}  {device}")


def mxfp8_dense(gen: torch.Generator, batches: list[int], shapes: dict[str, tuple[int, int]]) -> None:
    """MXFP8 W8A16 dense decode, graphed over rotating weight copies, us a call at `batches` rows:
    bf16 `torch.matmul`; the Gluon weight-only kernel (`gluon_wo_gemv.linear_mxfp8`, any row
    count); the weight dequantized once (`dispatch.dequantize_mxfp8`) then `F.linear`; and
    `int4_mxfp8_linear.mxfp8_weight_only_linear` (the kernel up to `triton_int4_gemv.KERNEL_MAX_ROWS` rows,
    dequantize + linear above): where the row limit belongs, per weight shape."""
    from skyq.rollout.kernels import gluon_wo_gemv, triton_fp8_gemv

    device = torch.cuda.get_device_name()
    rows = []

    def kernel(x, q, s):
        return gluon_wo_gemv.linear_mxfp8(
            x, q, s, sms=triton_fp8_gemv.sm_count(x.device), counters=triton_fp8_gemv._arrival_counters
        )

    def dequantized(x, q, s):
        return F.linear(x, dispatch.dequantize_mxfp8(q, s))

    columns = {
        "kernel": kernel,
        "dequantize + linear": dequantized,
        "default": int4_mxfp8_linear.mxfp8_weight_only_linear,
    }
    print(f"\nMXFP8 dense, us a call: bf16 | {' | '.join(columns)}")

    def timed(fns) -> float:  # the dequantizer's finite checks recorded in the graph, read once after
        with dispatch.deferred_finite_checks():
            return time_per_call(fns)

    with torch.inference_mode():
        for label, (n, k) in shapes.items():
            copies = max(1, min(64, (256 << 20) // (n * k)))
            ws = [(torch.randn(n, k, generator=gen) * 0.02).to(torch.bfloat16).cuda() for _ in range(copies)]
            qs = [dispatch.quantize_mxfp8(w) for w in ws]
            for m in batches:
                x = torch.randn(m, k, generator=gen).to(torch.bfloat16).cuda()
                tb = time_per_call([functools.partial(torch.matmul, x, w.T) for w in ws])
                times = {c: timed([functools.partial(f, x, q, s) for q, s in qs]) for c, f in columns.items()}
                print(f"{label:>20} {m:>4} rows: {tb * 1e6:6.1f} | "
                      + " | ".join(f"{t * 1e6:6.1f}" for t in times.values()), flush=True)  # fmt: skip
                rows += [(f"{label} us, {m} rows: mxfp8 {c} / bf16", t, tb) for c, t in times.items()]
    print(f"\n{'metric':<62} {'ours':>9} {'baseline':>9} {'ratio':>6}  device")
    for label, ours, base in rows:
        print(f"{label:<62} {ours * 1e6:>9.1f} {base * 1e6:>9.1f} {base / ours:>6.2f}  {device}")


def int4_gluon_configs(m: int, n: int, k: int) -> list[tuple[int, int, int, int, int, int]]:
    """(BM, BN, KC, split, warps, kwarps) variants of the Gluon weight-only (INT4, MXFP8) kernel for
    one dense shape and batch: `gluon_configs`' tiles (the INT4 kernel has no prefetch choice) plus the whole batch in
    one 32- or 64-row tile at 1-2 warps (the dequantization then done once per weight)."""
    out = list(dict.fromkeys(cfg for cfg, _ in gluon_configs(m, n, k)))
    if m > 16:
        top = min(64, 1 << (m - 1).bit_length())
        for bn, warps in ((16, 1), (32, 2)):
            for kw in (1, 2, 4, 8):
                for sp in (1, 2, 4):
                    cfg = (top, bn, 128, sp, warps, kw)
                    if cfg not in out and warps * kw <= 16 and -(-k // 128) >= 2 * sp * kw:
                        out.append(cfg)
    return out


def int4_grouped_configs() -> list[tuple[int, int, int, int, int, int]]:
    """Grouped Gluon weight-only (INT4, MXFP8) variants: BM 8-64, 16 or 32 weight rows a warp (1 or 2 warps), 1-4 K warps."""
    return [(bm, bn, 128, 1, w, kw) for bm in (8, 16, 32, 64) for bn, w in ((16, 1), (32, 1), (32, 2))
            for kw in (1, 2, 4)]  # fmt: skip


def _wo_operands(w: torch.Tensor, mx: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The Gluon weight-only kernels' weight operands of bf16 w: MXFP8 (e4m3 codes, E8M0 scales) or
    INT4 (packed words, bf16 group scales of `INT4_GROUP`)."""
    return dispatch.quantize_mxfp8(w) if mx else dispatch.quantize_int4_packed(w, group_size=INT4_GROUP)


def _wo_dense(x, q, s, mx: bool, sms: int, config=None):
    from skyq.rollout.kernels import gluon_wo_gemv as g
    from skyq.rollout.kernels import triton_fp8_gemv as kern

    if mx:
        return g.linear_mxfp8(x, q, s, sms=sms, counters=kern._arrival_counters, config=config)
    return g.linear(x, q, s, group_size=INT4_GROUP, sms=sms, counters=kern._arrival_counters, config=config)


def _wo_grouped(x, q, s, offsets, mx: bool, sms: int, config=None):
    from skyq.rollout.kernels import gluon_wo_gemv as g

    if mx:
        return g.linear_grouped_mxfp8(x, q, s, offsets, sms=sms, config=config)
    return g.linear_grouped(x, q, s, offsets, group_size=INT4_GROUP, sms=sms, config=config)


def _compile_wo_gluon_jobs(jobs: list) -> None:
    for mx, kind, m, n, k, cfg in jobs:
        x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
        if kind == "dense":
            q, s = _wo_operands(torch.zeros(n, k, device="cuda", dtype=torch.bfloat16), mx)
            _wo_dense(x, q, s, mx, 132, cfg)
        else:
            q, s = _wo_operands(torch.zeros(4, n, k, device="cuda", dtype=torch.bfloat16), mx)
            off = torch.tensor([0, m, m, m, m], dtype=torch.int32, device="cuda")
            _wo_grouped(x, q, s, off, mx, 132, cfg)
    torch.cuda.synchronize()


def wo_gluon_sweep(
    gen: torch.Generator, batches: list[int], tokens: list[int], log: str | None, mx: bool
) -> None:
    """Every Gluon weight-only variant (INT4, or MXFP8 with `mx`) per fused dense shape and batch, and
    per grouped expert shape and routed tokens, graphed over rotating weights, us a call: bf16, the
    Triton INT4 kernel (INT4 only), the Gluon default, the best 5. `log`: every timing as JSON lines."""
    import json

    from skyq.ops.grouped_mm import bf16_grouped_linear
    from skyq.rollout.kernels import triton_fp8_gemv as kern
    from skyq.rollout.kernels import triton_int4_gemv

    gs, sms = INT4_GROUP, kern.sm_count(torch.device("cuda"))
    jobs = {}
    for _, (n, k) in FUSED_SWEEP_SHAPES.items():
        for m in batches:
            for cfg in int4_gluon_configs(m, n, k):
                jobs.setdefault((cfg, k % cfg[2] == 0, m == 1, "dense"), (mx, "dense", m, n, k, cfg))
    for cfg in int4_grouped_configs():
        jobs.setdefault((cfg, "grouped"), (mx, "grouped", 8, 768, 2048, cfg))
    compile_in_parallel("gluon weight-only sweep", list(jobs.values()), _compile_wo_gluon_jobs)

    def report(label, tb, tt, td, res):
        if log:
            with open(log, "a") as f:
                for t, c in res:
                    f.write(json.dumps(dict(shape=label, mx=mx, cfg=c, us=t * 1e6, bf16=tb * 1e6)) + "\n")
        res.sort(key=lambda r: r[0])
        top = ", ".join(f"{'/'.join(map(str, c))} {t * 1e6:.1f}" for t, c in res[:5])
        triton = "" if tt is None else f", triton {tt * 1e6:.1f}"
        print(f"{label}: bf16 {tb * 1e6:.1f}{triton}, default {td * 1e6:.1f}, best {top}", flush=True)

    with torch.inference_mode():
        for label, (n, k) in FUSED_SWEEP_SHAPES.items():
            copies = max(1, min(64, (256 << 20) // (n * k)))
            ws = [(torch.randn(n, k, generator=gen) * 0.02).to(torch.bfloat16).cuda() for _ in range(copies)]
            ps = [_wo_operands(w, mx) for w in ws]
            for m in batches:
                x = torch.randn(m, k, generator=gen).to(torch.bfloat16).cuda()
                tb = time_per_call([functools.partial(torch.matmul, x, w.T) for w in ws])
                tt = None if mx else time_per_call(
                    [functools.partial(triton_int4_gemv.linear, x, p, s, group_size=gs) for p, s in ps]
                )  # fmt: skip
                td = time_per_call([functools.partial(_wo_dense, x, p, s, mx, sms) for p, s in ps])
                res = [(time_per_call([functools.partial(_wo_dense, x, p, s, mx, sms, c) for p, s in ps]), c)
                       for c in int4_gluon_configs(m, n, k)]  # fmt: skip
                report(f"{label} M={m}", tb, tt, td, res)
            del ws, ps
        for shape, (experts, hidden, inter, top_k) in INT4_EXPERT_SHAPES.items():
            for proj, (n, k) in (("gate_up", (2 * inter, hidden)), ("down", (hidden, inter))):
                wb = (torch.randn(experts, n, k, generator=gen) * 0.02).to(torch.bfloat16).cuda()
                q, s = _wo_operands(wb, mx)
                for t in tokens:
                    x, offsets = routed_rows(gen, t, experts, top_k, k)
                    tb = time_per_call([functools.partial(bf16_grouped_linear, x, wb, offsets)] * 8)
                    tt = None if mx else time_per_call([functools.partial(
                        triton_int4_gemv.linear_grouped, x, q, s, offsets, group_size=gs)] * 8)  # fmt: skip
                    td = time_per_call([functools.partial(_wo_grouped, x, q, s, offsets, mx, sms)] * 8)
                    res = [(time_per_call([functools.partial(_wo_grouped, x, q, s, offsets, mx, sms, c)] * 8), c)
                           for c in int4_grouped_configs()]  # fmt: skip
                    report(f"{shape} {proj} {t} tokens", tb, tt, td, res)
