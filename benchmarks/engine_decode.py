"""Decode tokens/s of the embedded engine itself on a GPU, same run: bf16 and FP8 blockwise weights (or
`--precisions`, e.g. bf16 int4_qat),
each with every step launched eagerly (transformers' growing cache, `rollout.cuda_graphs=false`) and
with the one-token step replayed from a CUDA graph (the default). Unlike benchmarks/decode.py (the
linears of a dense stack, graphed), this is `EmbeddedEngine.generate` end to end: prefill,
attention over the KV cache, routing, the grouped experts, the activation quantizers, sampling on
the host and the per-step checks.

Model: `small_moe`'s shape by default (the one-GPU run's model: Qwen3-MoE, 4 layers, hidden 1024,
32 experts of width 768, top-4; 0.31B parameters), random weights (every prompt and response token
random; eos never ends a row, so every row decodes `--new-tokens`). Tokens/s = rows x new tokens /
the median wall time of a `generate` call (after one untimed call, which captures the graph).

    python benchmarks/engine_decode.py [--batches 1 8 16 32 64] [--new-tokens 64] [--repeats 5]
        [--layers 4 --hidden 1024 --experts 32 --top-k 4 --expert-width 768 --vocab 32]
    python benchmarks/engine_decode.py --precisions bf16 int4_qat   # INT4 W4A16 (groups of 32) against bf16
    python benchmarks/engine_decode.py --precisions bf16 mxfp8 --targets all_linear  # attention MXFP8 too
    python benchmarks/engine_decode.py --profile [--batches 1 64]   # where a graphed step's time goes
    python benchmarks/engine_decode.py --ops [--batches 64]         # which operators (eager) launch it
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from skyq.config.enums import Precision, QuantScope
from skyq.config.schema import ModelConfig, PrecisionConfig
from skyq.quant.plan import build_plan
from skyq.quant.strategies import get_strategy
from skyq.rollout.embedded import EmbeddedEngine

PRECISIONS = ("bf16", "fp8_blockwise")
MODES = ("eager", "graph")


def model_config(args: argparse.Namespace) -> ModelConfig:
    return ModelConfig(
        name="engine_decode", hidden_size=args.hidden, num_layers=args.layers, num_attention_heads=args.hidden // 64,
        num_key_value_heads=4, head_dim=64, intermediate_size=3 * args.hidden, moe_intermediate_size=args.expert_width,
        num_experts=args.experts, num_experts_per_tok=args.top_k, vocab_size=args.vocab,
        max_position_embeddings=max(512, args.prompt_len + args.new_tokens),
    )  # fmt: skip


def random_wire(model_cfg: ModelConfig, precision_cfg: PrecisionConfig, gen: torch.Generator) -> dict:
    """The wire tensors of random HF weights (matrices ~N(0, 0.02), norms 1) for this precision."""
    strategy = get_strategy(precision_cfg)
    wire = {}
    for entry in build_plan(model_cfg, precision_cfg):
        if len(entry.shape) == 1:
            w = torch.ones(entry.shape, device="cuda")
        else:
            w = torch.randn(entry.shape, generator=gen, device="cuda") * 0.02
        w = w.to(entry.dtype)
        wire.update(
            strategy.serialize(entry.name, w, role=entry.role) if entry.quantized else {entry.name: w}
        )
    return wire


def engine_for(
    model_cfg: ModelConfig, precision: str, graphs: bool, gen_seed: int, targets: str | None = None
) -> EmbeddedEngine:
    precision_cfg = PrecisionConfig(name=Precision(precision))
    if targets is not None:  # the linears MXFP8 / INT4 quantize (FP8 blockwise: all of them already)
        precision_cfg.mxfp8_targets = precision_cfg.qat_scope = QuantScope(targets)
    engine = EmbeddedEngine(model_cfg=model_cfg, precision_cfg=precision_cfg, device="cuda", seed=0,
                            eos_token_id=-1, cuda_graphs=graphs)  # fmt: skip
    engine.load_weights(
        random_wire(model_cfg, precision_cfg, torch.Generator("cuda").manual_seed(gen_seed)), version=0
    )
    return engine


def tokens_per_s(engine: EmbeddedEngine, prompts: list[list[int]], new_tokens: int, repeats: int) -> float:
    def call(seed: int) -> None:
        engine.generate(prompts, n=1, max_new_tokens=new_tokens, temperature=1.0, top_p=1.0, seed=seed)

    call(0)  # compiles the kernels; in graph mode also captures the step
    times = []
    for r in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        call(r + 1)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return len(prompts) * new_tokens / statistics.median(times)


def profile(engine: EmbeddedEngine, prompts: list[list[int]], new_tokens: int, label: str, top: int) -> None:
    """Per kernel: device microseconds per decode step and launches per step of one `generate` call
    (after an untimed one), and the device-busy share of its wall time."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    def call(seed: int) -> None:
        engine.generate(prompts, n=1, max_new_tokens=new_tokens, temperature=1.0, top_p=1.0, seed=seed)

    call(0)
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        call(1)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    kernels = [e for e in prof.key_averages() if e.device_type.name == "CUDA" and e.device_time_total > 0]
    busy = sum(e.device_time_total for e in kernels)
    print(f"\n{label}: wall {wall * 1e6 / new_tokens:.0f} us a step, kernels busy {busy / new_tokens:.0f} us a step, "
          f"{sum(e.count for e in kernels) / new_tokens:.0f} launches a step")  # fmt: skip
    for e in sorted(kernels, key=lambda e: -e.device_time_total)[:top]:
        print(f"  {e.device_time_total / new_tokens:>8.1f} us {e.count / new_tokens:>6.1f}x  {e.key[:90]}")


def profile_ops(
    engine: EmbeddedEngine, prompts: list[list[int]], new_tokens: int, label: str, top: int
) -> None:
    """Per torch operator and input shapes: the device time of its own kernels a decode step, from one
    `generate` call through the graph mode's fixed-capacity cache, its steps launched eagerly (which
    operator a kernel of the graphed step's profile comes from)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    engine.decode_mode = "static"  # the graph mode's StaticCache, not captured
    engine.generate(prompts, n=1, max_new_tokens=new_tokens, temperature=1.0, top_p=1.0, seed=0)
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU], record_shapes=True) as prof:
        engine.generate(prompts, n=1, max_new_tokens=new_tokens, temperature=1.0, top_p=1.0, seed=1)
        torch.cuda.synchronize()
    ops = [e for e in prof.key_averages(group_by_input_shape=True) if e.self_device_time_total > 0]
    print(f"\n{label}: operators by their own device time a step")
    for e in sorted(ops, key=lambda e: -e.self_device_time_total)[:top]:
        print(f"  {e.self_device_time_total / new_tokens:>8.1f} us {e.count / new_tokens:>6.1f}x  {e.key[:40]:<40} "
              f"{str(e.input_shapes)[:110]}")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 16, 32, 64])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--expert-width", type=int, default=768)
    ap.add_argument("--vocab", type=int, default=32)
    ap.add_argument("--precisions", nargs="+", default=list(PRECISIONS), choices=[p.value for p in Precision],
                    help="weights to decode from (bf16 is the ratios' baseline)")  # fmt: skip
    ap.add_argument("--profile", action="store_true", help="per-kernel device time of the graph mode instead")
    ap.add_argument("--graph-only", action="store_true", help="the graph mode only (no eager runs)")
    ap.add_argument("--ops", action="store_true", help="per operator and input shapes, eager mode, instead")
    ap.add_argument("--top", type=int, default=15, help="kernels listed per profile")
    ap.add_argument("--targets", choices=[s.value for s in QuantScope], default=None,
                    help="precision.mxfp8_targets / qat_scope (default: routed experts)")  # fmt: skip
    args = ap.parse_args()
    device = torch.cuda.get_device_name()
    model_cfg = model_config(args)
    params = sum(p.bytes for p in build_plan(model_cfg, PrecisionConfig(name=Precision.bf16))) / 2
    print(f"device {device}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}; model {params / 1e9:.2f}B "
          f"parameters ({args.layers} layers, hidden {args.hidden}, {args.experts} experts x {args.expert_width}, "
          f"top-{args.top_k}), prompts of {args.prompt_len} + {args.new_tokens} new tokens")  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    prompts = {
        b: torch.randint(0, args.vocab, (b, args.prompt_len), generator=gen).tolist() for b in args.batches
    }
    if args.profile or args.ops:
        for precision in args.precisions:
            engine = engine_for(model_cfg, precision, True, gen_seed=1, targets=args.targets)
            for b in args.batches:
                (profile_ops if args.ops else profile)(
                    engine,
                    prompts[b],
                    args.new_tokens,
                    f"{precision} {'static eager' if args.ops else 'graph'}, batch {b}",
                    args.top,
                )
        return
    results: dict[tuple[str, str, int], float] = {}
    modes = ("graph",) if args.graph_only else MODES
    for precision in args.precisions:
        for mode in modes:
            engine = engine_for(model_cfg, precision, mode == "graph", gen_seed=1, targets=args.targets)
            for b in args.batches:
                results[precision, mode, b] = tokens_per_s(engine, prompts[b], args.new_tokens, args.repeats)
                print(f"{precision:>14} {mode:>6} batch {b:>4}: {results[precision, mode, b]:>10.0f} tokens/s",
                      flush=True)  # fmt: skip
            del engine
            torch.cuda.empty_cache()
    print(f"\n{'metric':<52} {'ours':>10} {'baseline':>10} {'ratio':>6}  device")
    short = {"fp8_blockwise": "fp8", "int4_qat": "int4"}
    for b in args.batches:
        pairs = []
        for p in (q for q in args.precisions if q != "bf16"):
            name = short.get(p, p)
            pairs += [(f"{name} graph / bf16 graph", (p, "graph"), ("bf16", "graph")),
                      (f"{name} eager / bf16 eager", (p, "eager"), ("bf16", "eager")),
                      (f"{name} graph / {name} eager", (p, "graph"), (p, "eager"))]  # fmt: skip
        pairs.append(("bf16 graph / bf16 eager", ("bf16", "graph"), ("bf16", "eager")))
        for label, ours, base in pairs:
            if (*ours, b) in results and (*base, b) in results:
                o, s = results[(*ours, b)], results[(*base, b)]
                print(
                    f"{f'engine tok/s, batch {b}: {label}':<52} {o:>10.0f} {s:>10.0f} {o / s:>6.2f}  {device}"
                )


if __name__ == "__main__":
    main()
