#!/usr/bin/env bash
# trainer=megatron on the lent H200 (issue 32), after Transformer Engine + megatron-core 0.19.2 are staged
# (stage.py --out .stage-te "transformer-engine[core_cu13]==2.20.2" megatron-core==0.19.2
# --wheel ../shared/wheels/transformer_engine_torch-2.20.2-cp312-cp312-linux_x86_64.whl; the last part
# installs into /tmp/stage-site; stage.py leaves megatron-core itself out, so a copy of the package is
# carried and put on PYTHONPATH as /tmp/mcore) and .gpu_bundle is carried. Logs and metrics land in $OUT.
#
#   bash scripts/gpu_box_megatron.sh a      # TE tests, training step per precision, GRPO fp8_blockwise
#   bash scripts/gpu_box_megatron.sh b      # GRPO bf16 and int4_qat, then the mismatch table of a + b
#   bash scripts/gpu_box_megatron.sh vllm   # trainer=megatron rollout=vllm, fp8_blockwise (vLLM 0.26 staged too)
#   bash scripts/gpu_box_megatron.sh opt    # the optimizer's cpu_offload / overlap / precision_aware: their GPU
#                                           # test, then GRPO fp8_blockwise with cpu_offload + precision_aware
#
# GRPO: recipe=small_moe_fp8_blockwise_1gpu (small_moe, arith) with trainer=megatron; trainer and engine
# are Ray actors on the one GPU (colocated through the placement plan). mxfp8 is not run: TE's
# MXFP8BlockScaling needs SM100 and TE has no emulation (te_env refuses it on the H200).
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_box_env.sh || exit 1
export PYTHONPATH="/tmp/mcore:/tmp/stage-site:$PYTHONPATH" VLLM_LOGGING_LEVEL=WARNING VLLM_USE_FLASHINFER_SAMPLER=0
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/rl-metrics
what=${1:-a}
python3 -c "import megatron.core, transformer_engine, torch; print('megatron-core', megatron.core.__version__, 'TE', transformer_engine.__version__, 'torch', torch.__version__)" 2>&1 | tail -1 | tee -a "$OUT/versions.txt"

step() {  # step NAME SECONDS COMMAND...: its log under $OUT, its exit code and time on stdout
  local name=$1 limit=$2
  shift 2
  echo "== $name (limit ${limit}s)"
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  echo "   exit $? at ${SECONDS}s"
}

rl() {  # rl PRECISION LIMIT [overrides...]
  local p=$1 limit=$2
  shift 2
  local run=/tmp/runs/$p${TAG:-}
  rm -rf "$run"
  step "rl_$p${TAG:-}" "$limit" python3 -m skyq.train recipe=small_moe_fp8_blockwise_1gpu trainer=megatron \
    precision="$p" algorithm.num_steps=6 hydra.run.dir="$run" logger.progress_bar=false logger.plot=false "$@"
  [ -f "$run/metrics.jsonl" ] && cp "$run/metrics.jsonl" "/tmp/rl-metrics/$p${TAG:-}.jsonl" \
    && cp "$run/metrics.jsonl" "$OUT/rl_$p${TAG:-}_metrics.jsonl"
  grep -E "placement|bundle|start-up: (trainer|engine)|Error|error:" "$OUT/rl_$p${TAG:-}.log" | tail -8
}

table() {  # the mismatch (mean |trainer - engine logp|) and reward per step of every GRPO run so far
  python3 - /tmp/rl-metrics/*.jsonl <<'PY' | tee "$OUT/mismatch_table.txt"
import json, pathlib, statistics, sys
rows = {}
for f in sys.argv[1:]:
    steps = [json.loads(line) for line in pathlib.Path(f).read_text().splitlines() if line.strip()]
    rows[pathlib.Path(f).stem] = steps
base = statistics.mean(s["mismatch/mean_abs_dlogp"] for s in rows["bf16"]) if "bf16" in rows else None
for name, steps in rows.items():
    mm = [s["mismatch/mean_abs_dlogp"] for s in steps]
    mean = statistics.mean(mm)
    ratio = f"{mean / base:.2f}x bf16" if base else ""
    print(f"{name:>16}: mismatch {' / '.join(f'{m:.4f}' for m in mm)}  mean {mean:.4f} {ratio}  "
          f"reward {steps[0]['reward']:.3f} -> {steps[-1]['reward']:.3f}  "
          f"synced {sum(1 for s in steps if s.get('sync/version'))}/{len(steps)}")
PY
}

case "$what" in
  a)
    nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv | tee "$OUT/gpu.txt"
    step test 150 python3 -m pytest -q -x -p no:cacheprovider tests/gpu/test_megatron_te.py
    tail -3 "$OUT/test.log"
    step bench 200 python3 benchmarks/megatron_step.py --model small_moe --rows 64 --seq 256 \
      --precisions bf16 fp8_blockwise int4_qat --json "$OUT/step_small.json"
    tail -6 "$OUT/bench.log"
    rl fp8_blockwise 200
    table
    ;;
  b)
    rl bf16 170
    rl int4_qat 170
    table
    ;;
  vllm)
    TAG=_vllm rl fp8_blockwise 420 rollout=vllm rollout.gpu_memory_fraction=0.3 rollout.kv_cache_bytes=4294967296
    table
    ;;
  opt)
    SKYQ_GPU_REPORT="$OUT/optimizer.json" step test_optimizer 300 \
      python3 -m pytest -q -x -s -p no:cacheprovider tests/gpu/test_megatron_optimizer.py
    tail -4 "$OUT/test_optimizer.log"
    rl fp8_blockwise 200
    TAG=_offload rl fp8_blockwise 200 trainer.optimizer.cpu_offload=true trainer.optimizer.overlap_cpu_offload=true \
      trainer.optimizer.precision_aware=true
    table
    ;;
  *) echo "usage: $0 a|b|vllm|opt" >&2; exit 2 ;;
esac
