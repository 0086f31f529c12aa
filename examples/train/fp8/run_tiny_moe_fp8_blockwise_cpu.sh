#!/usr/bin/env bash
# The embedded default as a recipe: tiny Qwen3-MoE, GRPO on arith, FP8 blockwise, CPU only.
# Recipe: recipes/tiny_moe_fp8_blockwise_cpu.yaml. DRY_RUN=1 prints the resolved plan instead of starting.
# Extra overrides pass through: ./run_tiny_moe_fp8_blockwise_cpu.sh algorithm.lr=2e-6
set -euo pipefail
cd "$(dirname "$0")/../../.."
PY=${PY:-.venv/bin/python}

# NVLink multicast off (NCCL NVLS): multicast objects are not lent on shared machines.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
extra=()
[ "${DRY_RUN:-0}" = 1 ] && extra+=(dry_run=true)
exec "$PY" -m skyq.train recipe=tiny_moe_fp8_blockwise_cpu \
  "${extra[@]}" "$@"
