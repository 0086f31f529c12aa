"""M1: quantizer throughput as a fraction of the device-copy bandwidth measured in the same run.

    python benchmarks/quantizers.py [--size 16384] [--rounds 5] [--json out.json]
    python benchmarks/quantizers.py --decode-sizes   # 1 x 128 fake quant of decode inputs: latency

`--decode-sizes`: the activation fake quantization (the FP8 recipe's 1 x 128 tiles, one pass) of
the few-row inputs a decode step quantizes, graphed over 16 inputs (launch gaps out), us a call:
the default band (`triton_fp8_blockwise.quant_tile`) beside every rows-a-program x warps variant and
the wide band these sizes used before (`ROW_TILE_ELEMENTS`), with a trivial kernel's time for scale.

For each format, on one [size, size] bf16 tensor: our Triton kernel (the public dispatch call,
which includes the in-kernel finiteness check and its one host sync, and the bare launch), the
torch.compile'd reference and the eager reference. eta = (bytes read + bytes written) / time /
copy bandwidth, where the copy is `dst.copy_(src)` of the same tensor (2 x its bytes moved).
Each round times every variant once (median of do_bench); the table gives the median over rounds
and the [min, max] spread. Outputs are checked bit for bit against the reference first.
Needs a CUDA GPU, torch and triton only.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
from collections.abc import Callable

import torch
import triton.testing

from skyq.quant import fp8_blockwise, int4, mxfp8
from skyq.quant.kernels import dispatch, triton_fp8_act, triton_fp8_blockwise, triton_int4, triton_mxfp8

FP8_SWEEP = [(8, 128), (16, 128), (8, 32), (8, 64)]  # (num_warps, rows per slice)
WARPS_SWEEP = [(4, None), (8, None), (16, None)]
INT4_SWEEP = [(8, 8192), (4, 4096), (4, 8192), (8, 16384), (16, 16384)]  # (num_warps, elements per program)
ROWS_COLS_SWEEP = [
    (4, 16),
    (8, 16),
    (8, 32),
    (16, 32),
    (4, 128),
    (8, 128),
    (16, 128),
]  # (num_warps, slice width; 128 = whole tile)
BARS = {"fp8_blockwise": 0.85, "fp8_blockwise_ue8m0": 0.85, "mxfp8": 0.85, "int4_pack_g128": 0.70}


def time_ms(fn: Callable[[], object]) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[a.element_size()]
    return a.shape == b.shape and a.dtype == b.dtype and bool((a.view(as_int) == b.view(as_int)).all())


def int4_reference(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    q, s = int4.quantize(w, group_size=128, grid="rtn")
    return int4.pack(q), s


def build_cases(x: torch.Tensor) -> dict[str, dict]:
    """name -> bytes moved, the variants to time, and the (ours, reference) outputs to compare."""
    n = x.numel()
    fp8_bytes = n * 2 + n + (n // 16384) * 4
    cases = {
        "fp8_blockwise": {
            "bytes": fp8_bytes,
            "ours": lambda: dispatch.quantize_fp8_blockwise(x),
            "kernel": lambda nw, sub: triton_fp8_blockwise.launch_quantize(
                x, block_size=(128, 128), pow2_scale=False, num_warps=nw, sub=sub
            ),
            "sweep": FP8_SWEEP,
            "reference": fp8_blockwise.quantize,
        },
        "fp8_blockwise_ue8m0": {
            "bytes": fp8_bytes,
            "ours": lambda: dispatch.quantize_fp8_blockwise(x, pow2_scale=True),
            "kernel": lambda nw, sub: triton_fp8_blockwise.launch_quantize(
                x, block_size=(128, 128), pow2_scale=True, num_warps=nw, sub=sub
            ),
            "sweep": [(8, 32)],
            "reference": lambda w: fp8_blockwise.quantize(w, pow2_scale=True),
        },
        "mxfp8": {
            "bytes": n * 2 + n + n // 32,
            "ours": lambda: dispatch.quantize_mxfp8(x),
            "kernel": lambda nw, sub: triton_mxfp8.launch_quantize(x, num_warps=nw),
            "sweep": WARPS_SWEEP,
            "reference": mxfp8.quantize,
        },
        "int4_pack_g128": {
            "bytes": n * 2 + n // 2 + (n // 128) * 2,
            "ours": lambda: dispatch.quantize_int4_packed(x, group_size=128, grid="rtn"),
            "kernel": lambda nw, tile: triton_int4.launch_quantize(
                x, group_size=128, grid="rtn", codes=False, packed=True, num_warps=nw, tile_elements=tile
            ),
            "sweep": INT4_SWEEP,
            "reference": int4_reference,
        },
    }
    return cases


def build_dequant_cases(x: torch.Tensor) -> dict[str, dict]:
    n = x.numel()
    q8, s8 = fp8_blockwise.quantize(x)
    qm, sm = mxfp8.quantize(x)
    p4, s4 = int4_reference(x)
    shape = list(x.shape)
    return {
        "fp8_blockwise_dequant": {
            "bytes": n + n * 2,
            "ours": lambda: dispatch.dequantize_fp8_blockwise(q8, s8),
            "reference": lambda: fp8_blockwise.dequantize(q8, s8),
        },
        "mxfp8_dequant": {
            "bytes": n + n // 32 + n * 2,
            "ours": lambda: dispatch.dequantize_mxfp8(qm, sm),
            "reference": lambda: mxfp8.dequantize(qm, sm),
        },
        "int4_dequant_g128": {
            "bytes": n // 2 + (n // 128) * 2 + n * 2,
            "ours": lambda: dispatch.dequantize_int4_packed(p4, s4, shape),
            "reference": lambda: int4.dequantize_packed(p4, s4, shape),
        },
    }


def summarize(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


DECODE_INPUTS = [(1, 2048), (1, 6144), (16, 2048), (16, 4096), (64, 2048), (64, 6144), (256, 2048)]


def time_graphed_us(fns: list[Callable[[], object]]) -> float:
    """us per call of a CUDA graph making every call in `fns` once (decode.py's timing)."""
    from decode import time_per_call  # benchmarks/ is the script's directory

    return time_per_call(fns) * 1e6


def decode_sizes(device: str) -> None:
    gen = torch.Generator().manual_seed(0)
    t0 = torch.zeros(16, device="cuda")
    print(f"{device}: a trivial graphed kernel {time_graphed_us([lambda: t0.add_(1.0)] * 64):.2f} us a call")
    wide = triton_fp8_blockwise.ROW_TILE_ELEMENTS // 128
    rows = []
    for m, k in DECODE_INPUTS:
        xs = [torch.randn(m, k, generator=gen).to(torch.bfloat16).cuda() for _ in range(16)]

        def fake(tn: int | None = None, warps: int | None = None, xs: list = xs) -> float:
            bands = triton_fp8_blockwise.SMALL_ROW_BANDS
            if tn is not None:  # this band for every size
                triton_fp8_blockwise.SMALL_ROW_BANDS = ((1 << 30, tn, warps),)
            try:
                return time_graphed_us([lambda x=x: triton_fp8_blockwise.launch_quantize(
                    x, block_size=(1, 128), pow2_scale=False, fake=True) for x in xs])  # fmt: skip
            finally:
                triton_fp8_blockwise.SMALL_ROW_BANDS = bands

        variants = sorted(
            (fake(tn, w), tn, w)
            for tn in (1, 2, 4, 8, 16, 32, 64)
            for w in (1, 2, 4, 8)
            if tn * 128 >= w * 32
        )
        ours, before = fake(), fake(wide, triton_fp8_blockwise.num_warps_for(wide * 128))
        best = ", ".join(f"{t:.2f} ({tn} rows, {w} warps)" for t, tn, w in variants[:3])
        print(f"{m:>4} x {k}: default {ours:.2f} us, wide band {before:.2f}; fastest {best}", flush=True)
        rows.append((m, k, ours, before))
    print("\n| metric | ours | baseline | ratio | device |")
    print("|---|---|---|---|---|")
    for m, k, ours, before in rows:
        print(
            f"| 1x128 fake quant {m} x {k}, us | {ours:.2f} | {before:.2f} (wide band) | {before / ours:.2f}x | {device} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=16384)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", default=None)
    parser.add_argument("--formats", nargs="+", default=None, help="time only these formats (quick runs)")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile baselines")
    parser.add_argument(
        "--decode-sizes", action="store_true", help="activation fake quant latency at decode sizes"
    )
    args = parser.parse_args()
    device = torch.cuda.get_device_name()
    if args.decode_sizes:
        decode_sizes(device)
        return
    torch.manual_seed(0)
    x = torch.randn(args.size, args.size, device="cuda").to(torch.bfloat16)
    dst = torch.empty_like(x)
    copy_bytes = 2 * x.numel() * x.element_size()
    cases, dequant = build_cases(x), build_dequant_cases(x)
    if args.formats:
        cases = {k: v for k, v in cases.items() if k in args.formats}
        dequant = {k: v for k, v in dequant.items() if k in args.formats}

    identical = {}
    for name, case in cases.items():
        identical[name] = all(same_bits(a, b) for a, b in zip(case["ours"](), case["reference"](x)))
    for name, case in dequant.items():
        identical[name] = same_bits(case["ours"](), case["reference"]())
    compiled = {
        name: case["reference"] if args.no_compile else torch.compile(case["reference"])
        for name, case in cases.items()
    }
    for fn in compiled.values():
        fn(x)  # compile outside the timed region

    eta: dict[str, dict[str, list[float]]] = {}
    copy_tbps = []
    for _ in range(args.rounds):
        copy_bw = copy_bytes / time_ms(lambda: dst.copy_(x)) / 1e9
        copy_tbps.append(copy_bw)
        variants: dict[str, tuple[int, Callable[[], object]]] = {}
        for name, case in cases.items():
            variants[f"{name}/ours"] = (case["bytes"], case["ours"])
            for nw, sub in case["sweep"]:
                variants[f"{name}/kernel_w{nw}_s{sub}"] = (
                    case["bytes"],
                    lambda c=case, nw=nw, sub=sub: c["kernel"](nw, sub),
                )
            variants[f"{name}/compile"] = (case["bytes"], lambda f=compiled[name]: f(x))
            variants[f"{name}/eager"] = (case["bytes"], lambda c=case: c["reference"](x))
        for name, case in dequant.items():
            variants[f"{name}/ours"] = (case["bytes"], case["ours"])
            variants[f"{name}/eager"] = (case["bytes"], case["reference"])
        act_bytes = 4 * x.numel() + 8 * (x.numel() // 128)
        for nw, sub in [] if args.formats else ROWS_COLS_SWEEP:
            variants[f"activation_rows_cols/kernel_w{nw}_s{sub}"] = (
                act_bytes,
                lambda nw=nw, sub=sub: triton_fp8_act.quantize_rows_cols(x, sub=sub, num_warps=nw),
            )
        if not args.formats:
            variants["activation_rows/kernel"] = (
                3 * x.numel() + 4 * (x.numel() // 128),
                lambda: triton_fp8_act.quantize_rows(x),
            )
        for key, (nbytes, fn) in variants.items():
            eta.setdefault(key, {"eta": []})["eta"].append(nbytes / time_ms(fn) / 1e9 / copy_bw)
        # the public calls as weight sync makes them: finiteness flags read once per 256 calls
        with dispatch.deferred_finite_checks(max_pending=256):
            for name, case in cases.items():
                t = time_ms(case["ours"])
                eta.setdefault(f"{name}/ours_deferred", {"eta": []})["eta"].append(
                    case["bytes"] / t / 1e9 / copy_bw
                )

    results = {key: summarize(v["eta"]) for key, v in eta.items()}
    record = {
        "date": datetime.date.today().isoformat(),
        "device": device,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "size": args.size,
        "rounds": args.rounds,
        "copy_TBps": summarize(copy_tbps),
        "bit_identical": identical,
        "eta": results,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=2)

    print(
        f"\ncopy ceiling: {record['copy_TBps']['median']:.2f} TB/s (read+write), {args.rounds} rounds, {device}"
    )
    print("all variants (eta = bytes/s over copy bytes/s; median [min, max]):")
    for key, r in results.items():
        print(f"  {key:36s} {r['median']:.3f} [{r['min']:.3f}, {r['max']:.3f}]")
    print("\n| metric | ours | baseline | ratio | device |")
    print("|---|---|---|---|---|")
    for name in list(cases) + list(dequant):
        ours, eager = results[f"{name}/ours"], results[f"{name}/eager"]
        if name in cases:
            comp = results[f"{name}/compile"]
            bar = BARS[name]
            verdict = "PASS" if ours["median"] >= bar else "MISS"
            print(
                f"| M1 {name} eta (bar {bar}, {verdict}; bits {'==' if identical[name] else '!='} ref) | "
                f"{ours['median']:.3f} [{ours['min']:.3f}-{ours['max']:.3f}] | compile {comp['median']:.3f}, "
                f"eager {eager['median']:.3f} | {ours['median'] / comp['median']:.2f}x compile | {device} |"
            )
        else:
            print(
                f"| {name} eta (bits {'==' if identical[name] else '!='} ref) | {ours['median']:.3f} | "
                f"eager {eager['median']:.3f} | {ours['median'] / eager['median']:.2f}x eager | {device} |"
            )


if __name__ == "__main__":
    main()
