#!/usr/bin/env bash
# The vLLM backend's H200 checks left by issue 37, in one device call (<= 9 min), from the repository root
# on the lent box once vLLM 0.26.0 is staged into /tmp/stage-site (`sh .stage/pN/recv.sh --install`,
# carrying .stage/pN and .gpu_bundle):
#
#   bash scripts/gpu_box_vllm_run.sh
#
# 1. int4_test: tests/gpu/test_vllm_int4_gpu.py: a W4A16 engine (Marlin MoE) booted with dummy weights
#    takes skyq's INT4 sync and equals, bit for bit, one booted from the converted checkpoint (both QAT
#    scopes), sync after sync.
# 2. int4_rl: a short GRPO run, `rollout=vllm precision=int4_qat` on the one-GPU recipe (trainer and
#    engine as Ray actors sharing the GPU): every sync accounted, the mismatch per step. RL_TRAINER=megatron
#    (and RL_LIMIT seconds) runs it with trainer=megatron.
# 3. mm-*: trainer vs vLLM mismatch of FP8 blockwise with ue8m0 scales on vLLM's W8A8 path beside bf16
#    (benchmarks/vllm_rollout.py, CUDA graphs; DeepGEMM compiles lazily, VLLM_DEEP_GEMM_WARMUP=skip).
#    precision.scale_format=ue8m0 alone sets VLLM_USE_DEEP_GEMM_E8M0=1 for the engine (power-of-two
#    activation scales, as the trainer's): the log's "vLLM env" line shows it.
# 4. dec-*: bf16 decode tokens/s with vLLM's engine core in the engine's process and in its own
#    (`rollout.engine_core_process=true`), same model, CUDA graphs.
#
# 3 and 4 are four benchmark processes that boot at the start, in the background, while 1 and 2 run, and
# measure one at a time (`--turn`) only after 1 and 2 are done: this script holds the turn lock until then.
# Every step has its own time limit; logs and results land in $OUT; the summary lines come last.
set -u
cd "$(dirname "$0")/.."
source scripts/gpu_box_env.sh || exit 1
export PYTHONPATH="/tmp/stage-site:$PYTHONPATH" VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_LOGGING_LEVEL=WARNING
OUT=${OUT:-/tmp/skyq-out}
mkdir -p "$OUT"
turn=/tmp/skyq-run-turn results=/tmp/skyq-run-results run=/tmp/skyq-run-int4
rm -rf "$turn" "$results" "$run" && mkdir -p "$turn" "$results"

step() {  # step NAME SECONDS COMMAND...: in the foreground, without the turn lock's descriptor
  local name=$1 limit=$2
  shift 2
  echo "== $name (limit ${limit}s, at ${SECONDS}s)"
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1 9>&-
  echo "   $name: exit $? at ${SECONDS}s"
}

background() {  # background NAME SECONDS COMMAND...
  local name=$1 limit=$2
  shift 2
  echo "== $name started in the background (limit ${limit}s, at ${SECONDS}s)"
  (timeout "$limit" "$@" >"$OUT/$name.log" 2>&1; echo "   $name: exit $? at ${SECONDS}s") &
}

nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv >"$OUT/gpu.txt" 2>&1
b=(python3 benchmarks/vllm_rollout.py)
common=(--cuda-graphs --skip-embedded --no-baseline --gpu-memory-fraction 0.02 --turn "$turn:4" --turn-wait-s 420)
mismatch=(--repeats 1 --decode-repeats 1 --batches 16)
w8a8=(--engine-env VLLM_BLOCKSCALE_FP8_GEMM_FLASHINFER=0 --vllm-kwarg 'moe_backend="triton"'
  --engine-env VLLM_DEEP_GEMM_WARMUP=skip)
decode=(--decode-only --precisions bf16 --batches 1 4 16 64 256 --decode-repeats 2)
background mm-bf16 525 "${b[@]}" "${common[@]}" "${mismatch[@]}" --precisions bf16 --label bf16 \
  --json "$results/mm-bf16.json"
background mm-fp8-ue8m0 525 "${b[@]}" "${common[@]}" "${mismatch[@]}" --precisions fp8_blockwise \
  --label fp8_w8a8_ue8m0 "${w8a8[@]}" --json "$results/mm-fp8-ue8m0.json" precision.scale_format=ue8m0
background dec-core-in-actor 525 "${b[@]}" "${common[@]}" "${decode[@]}" --label bf16_core_in_actor \
  --json "$results/dec-in-actor.json"
background dec-core-own-process 525 "${b[@]}" "${common[@]}" "${decode[@]}" --label bf16_core_own_process \
  --json "$results/dec-own-process.json" rollout.engine_core_process=true

# Hold the turn lock (opened after the background starts, so they do not share it) while 1 and 2 run.
exec 9>>"$turn/lock"
if command -v flock >/dev/null; then
  flock -x 9
else
  echo "   no flock here: the benchmark processes may measure while steps 1 and 2 run"
fi

step int4_test 180 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_vllm_int4_gpu.py
# RL_TRAINER=megatron: the same run with the Megatron trainer (TE, megatron-core staged too: gpu_box_megatron.sh)
step int4_rl "${RL_LIMIT:-180}" python3 -m skyq.train recipe=small_moe_fp8_blockwise_1gpu rollout=vllm precision=int4_qat \
  trainer="${RL_TRAINER:-torch}" \
  algorithm.num_steps=6 rollout.gpu_memory_fraction=0.3 rollout.kv_cache_bytes=4294967296 \
  hydra.run.dir="$run" logger.progress_bar=false logger.plot=false
[ -f "$run/metrics.jsonl" ] && cp "$run/metrics.jsonl" "$OUT/int4_rl_metrics.jsonl"

command -v flock >/dev/null && flock -u 9
exec 9>&-
echo "== turn lock released at ${SECONDS}s; waiting for the benchmark processes"
wait

echo
echo "---- summary"
echo "--- int4_test"
grep -E "passed|failed|skipped|Error" "$OUT/int4_test.log" | tail -8
echo "--- int4_rl (step, weight version, reward, mismatch mean / max abs dlogp, sync s)"
if [ -f "$OUT/int4_rl_metrics.jsonl" ]; then
  python3 -c '
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    print("  step {} version {} reward {:.3f} mismatch {:.5f} / {:.4f} sync {:.2f}".format(
        r["step"], r["weight_version"], r["reward"], r["mismatch/mean_abs_dlogp"],
        r["mismatch/max_abs_dlogp"], r.get("sync/total_s", float("nan"))))' "$OUT/int4_rl_metrics.jsonl"
else
  grep -E "Error|error|refus" "$OUT/int4_rl.log" | tail -8
fi
for name in mm-bf16 mm-fp8-ue8m0 dec-core-in-actor dec-core-own-process; do
  grep -h -E "Error|error|skipped|refused|Killed" "$OUT/$name.log" | tail -3 | sed "s/^/  [$name] /"
done
echo "--- mismatch: fp8 blockwise ue8m0 scales (w8a8) beside bf16"
grep -h -o "vLLM env {[^}]*}" "$OUT/mm-fp8-ue8m0.log" | head -1
ls "$results"/mm-*.json >/dev/null 2>&1 && "${b[@]}" --combine "$results"/mm-*.json 2>&1 | tee "$OUT/mismatch.txt"
echo "--- decode tokens/s: engine core in the engine's process vs in its own"
ls "$results"/dec-*.json >/dev/null 2>&1 && "${b[@]}" --combine "$results"/dec-*.json 2>&1 | tee "$OUT/decode.txt"
