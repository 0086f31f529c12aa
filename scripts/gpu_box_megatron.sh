#!/usr/bin/env bash
# trainer=megatron on the lent H200 (issue 32), one call after Transformer Engine + megatron-core 0.19.2
# are staged (stage.py --out .stage-te "transformer-engine[core_cu13]==2.20.2" megatron-core==0.19.2
# --wheel ../shared/wheels/transformer_engine_torch-2.20.2-cp312-cp312-linux_x86_64.whl; the last part
# installs into /tmp/stage-site) and .gpu_bundle is carried. Everything it prints is also under $OUT.
#
#   sh .stage-te/p4/recv.sh --install && bash scripts/gpu_box_megatron.sh [test|bench|rl|all]
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_box_env.sh
export PYTHONPATH="/tmp/stage-site:$PYTHONPATH"
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
what=${1:-all}
python3 -c "import megatron.core, transformer_engine.pytorch as te, torch; print('megatron-core', megatron.core.__version__, 'TE', __import__("transformer_engine").__version__, 'torch', torch.__version__)" 2>&1 | tail -1 | tee "$OUT/versions.txt"

if [ "$what" = test ] || [ "$what" = all ]; then
  timeout 240 python3 -m pytest -q -x -p no:cacheprovider tests/gpu/test_megatron_te.py 2>&1 | tail -30 | tee "$OUT/test.txt"
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  timeout 240 python3 benchmarks/megatron_step.py --model small_moe --rows 64 --seq 256 \
    --json "$OUT/step_small.json" 2>&1 | tail -12 | tee "$OUT/bench.txt"
fi
if [ "$what" = rl ] || [ "$what" = all ]; then
  for p in fp8_blockwise bf16; do
    timeout 170 python3 -m skyq.train recipe=small_moe_fp8_blockwise_1gpu trainer=megatron precision=$p \
      algorithm.num_steps=6 output_root=/tmp/runs 2>&1 | tail -25 | tee "$OUT/rl_$p.txt"
  done
  find /tmp/runs -name "metrics.jsonl" | head -4 | while read -r f; do
    cp "$f" "$OUT/$(basename "$(dirname "$f")")_metrics.jsonl"
  done
fi
