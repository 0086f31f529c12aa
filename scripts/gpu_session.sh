#!/usr/bin/env bash
# One device call's worth of GPU measurements, logs under $OUT (the device tool's folder) or ./gpu_logs.
# On the box, from the repository root, after `source scripts/gpu_box_env.sh`:
#   scripts/gpu_session.sh bench    # M2 sync, M5 mismatch, M3 linear, M4 decode, M1 quantizers (~6 min)
#   scripts/gpu_session.sh tests-a  # first half of the GPU tests (quant kernels)
#   scripts/gpu_session.sh tests-b  # the rest (engine, gemv, fp8 linear, converters on the GPU)
#   scripts/gpu_session.sh nccl     # two GPUs: NCCL check, sync benchmark over NCCL, a 2-GPU run (~6 min)
# Each step has its own time limit, so one hang costs that step, not the call; the last lines of every
# log are printed at the end (the call's output tail) and the whole logs come back from $OUT.
set -u
out="${OUT:-gpu_logs}"
mkdir -p "$out"
step() {  # step NAME SECONDS COMMAND...
  local name=$1 limit=$2
  shift 2
  echo "== $name (limit ${limit}s)"
  timeout "$limit" "$@" >"$out/$name.log" 2>&1
  echo "   exit $? after $SECONDS s of the session"
}
case "${1:-}" in
  bench)
    step sync 90 python3 benchmarks/sync.py --layers 2 --repeats 5
    step mismatch 120 python3 benchmarks/mismatch.py --model small_moe --device cuda --prompts 64
    step fp8_linear 90 python3 benchmarks/fp8_linear.py --rounds 3
    step decode 90 python3 benchmarks/decode.py --no-sweep
    step quantizers 120 python3 benchmarks/quantizers.py --no-compile --rounds 2
    tails="sync:M2 mismatch:M5 fp8_linear:M3 decode:tokens quantizers:eta"
    ;;
  tests-a)
    step gpu_tests_a 540 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_quant_kernels.py
    tails="gpu_tests_a:passed"
    ;;
  tests-b)
    step gpu_tests_b 540 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu \
      --deselect tests/gpu/test_quant_kernels.py tests/tools/test_device.py
    tails="gpu_tests_b:passed"
    ;;
  nccl)
    step nccl_check 120 python3 -m tests.sync.nccl_check
    step sync_nccl 240 python3 benchmarks/sync_nccl.py --layers 2 --repeats 5
    step run_2gpu 300 python3 -m skyq.train recipe=small_moe_fp8_blockwise_2gpu \
      algorithm.num_steps=24 logger.progress_bar=false output_root=/tmp/runs_2gpu
    cp /tmp/runs_2gpu/*/metrics.jsonl "$out/run_2gpu_metrics.jsonl" 2>/dev/null
    tails="nccl_check:. sync_nccl:M2|GB|format run_2gpu:run|reward|step"
    ;;
  *)
    echo "usage: $0 bench|tests-a|tests-b|nccl" >&2
    exit 2
    ;;
esac
for pair in $tails; do  # the summary lines of each log
  name=${pair%%:*} pattern=${pair#*:}
  echo "--- $name"
  grep -E "$pattern|Error|FAILED" "$out/$name.log" | tail -12
done
