#!/usr/bin/env bash
# The vLLM backend's H200 measurements (issue 37) in two device calls, run from the repository root on
# the lent box after the vLLM 0.26.0 stage is installed (`sh .stage/pN/recv.sh --install`, carrying
# .stage/pN and .gpu_bundle). Results land in $OUT (at most 8 files come back).
#
#   bash scripts/gpu_box_vllm_bench.sh bench   # decode / sync / mismatch, every variant side by side
#   bash scripts/gpu_box_vllm_bench.sh rl      # rollout=vllm GRPO runs: int4_qat and mxfp8
#
# bench: the variants are separate processes (vLLM reads its environment at import) that boot at once,
# so their CPU-bound compiles overlap, and measure one at a time (benchmarks/vllm_rollout.py --turn).
# small_moe (0.31B) with the trainer: sync, decode and trainer-vs-vLLM mismatch per variant; a
# Qwen3-30B-A3B-shaped model cut to 12 layers (8.1B parameters, random weights): decode alone, where
# decode reads enough weights per step to be bound by them rather than by launches. FP8 variants:
# w8a8 = vLLM's block-FP8 path (FP8 activations quantized per 1x128 group; FlashInfer's JIT-built GEMM
# off, so CUTLASS and the Triton fused MoE), w8a16 = vLLM's Marlin kernels (FP8 weights dequantized in
# registers, bf16 activations: the function skyq's trainer computes).
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_box_env.sh || exit 1
export PYTHONPATH="/tmp/stage-site:$PYTHONPATH" VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_LOGGING_LEVEL=WARNING
OUT=${OUT:-/tmp/skyq-out}
mkdir -p "$OUT"
LOG="$OUT/${1:-bench}_log.txt"

prefixed() {  # run "$@" with its output prefixed by the tag $1, appended to $LOG
  local tag=$1
  shift
  "$@" 2>&1 | sed -u "s/^/[$tag] /" >>"$LOG"
}

bench() {
  local turn=/tmp/skyq-turn results=/tmp/skyq-bench
  rm -rf "$turn" "$results" && mkdir -p "$results"
  nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv >>"$LOG"
  python3 -c "import importlib.util as u; print('deep_gemm', u.find_spec('deep_gemm') is not None)" >>"$LOG" 2>&1
  local common=(--cuda-graphs --skip-embedded --no-baseline --repeats 3 --decode-repeats 2
    --gpu-memory-fraction 0.02 --turn "$turn:9")
  local w8a8=(--engine-env VLLM_BLOCKSCALE_FP8_GEMM_FLASHINFER=0 --vllm-kwarg 'moe_backend="triton"')
  local w8a16=(--engine-env VLLM_TEST_FORCE_FP8_MARLIN=1 --vllm-kwarg 'moe_backend="marlin"'
    --vllm-kwarg 'linear_backend="marlin"')
  local large=(--model qwen3_30b --decode-only --kv-cache-mib 3072 model.num_layers=12)
  local b="python3 benchmarks/vllm_rollout.py"
  local t=540
  prefixed s-bf16 timeout $t $b "${common[@]}" --precisions bf16 --label bf16 --json $results/s-bf16.json &
  prefixed s-fp8a8 timeout $t $b "${common[@]}" --precisions fp8_blockwise --label fp8_w8a8 "${w8a8[@]}" \
    --json $results/s-fp8a8.json &
  prefixed s-fp8a16 timeout $t $b "${common[@]}" --precisions fp8_blockwise --label fp8_w8a16 "${w8a16[@]}" \
    --json $results/s-fp8a16.json &
  prefixed s-fp8a16p2 timeout $t $b "${common[@]}" --precisions fp8_blockwise --label fp8_w8a16_ue8m0 \
    "${w8a16[@]}" --json $results/s-fp8a16p2.json precision.scale_format=ue8m0 &
  prefixed s-mxfp8 timeout $t $b "${common[@]}" --precisions mxfp8 --label mxfp8 --json $results/s-mxfp8.json \
    precision.emulate=true &
  prefixed s-int4 timeout $t $b "${common[@]}" --precisions int4_qat --label int4_qat --json $results/s-int4.json &
  prefixed l-bf16 timeout $t $b "${common[@]}" "${large[@]}" --precisions bf16 --label bf16 \
    --json $results/l-bf16.json &
  prefixed l-fp8a8 timeout $t $b "${common[@]}" "${large[@]}" --precisions fp8_blockwise --label fp8_w8a8 \
    "${w8a8[@]}" --json $results/l-fp8a8.json &
  prefixed l-fp8a16 timeout $t $b "${common[@]}" "${large[@]}" --precisions fp8_blockwise --label fp8_w8a16 \
    "${w8a16[@]}" --json $results/l-fp8a16.json &
  wait
  {
    echo "== small_moe (0.31B), trainer + vLLM, CUDA graphs"
    $b --combine $results/s-*.json
    echo "== qwen3_30b shape, 12 layers (random weights), decode only, CUDA graphs"
    $b --combine $results/l-*.json
  } >"$OUT/summary.txt" 2>&1
  for f in "$results"/*.json; do echo "== $f"; cat "$f"; done >"$OUT/results.txt"
  cat "$OUT/summary.txt"
}

rl() {
  local p run
  for p in int4_qat mxfp8; do
    run=/tmp/skyq-rl-$p
    rm -rf "$run"
    local extra=()
    [ "$p" = mxfp8 ] && extra=(precision.emulate=true)
    prefixed "rl-$p" timeout 280 python3 -m skyq.train recipe=small_moe_fp8_blockwise_1gpu rollout=vllm \
      precision=$p "${extra[@]}" algorithm.num_steps=6 rollout.gpu_memory_fraction=0.3 \
      rollout.kv_cache_bytes=4294967296 hydra.run.dir=$run logger.progress_bar=false logger.plot=false
    [ -f $run/metrics.jsonl ] && sed "s/^/[$p] /" $run/metrics.jsonl >>"$OUT/rl_metrics.txt"
  done
  grep -h -E "start-up|run /|Error|error|refus" "$LOG" | tail -40
}

case "${1:-}" in
  bench) bench ;;
  rl) rl ;;
  *) echo "usage: $0 bench|rl" >&2; exit 2 ;;
esac
