#!/usr/bin/env bash
# The two-GPU embedded run: small_moe (0.31B Qwen3-MoE), GRPO on arith, FP8 blockwise; trainer and
# engine on separate GPUs (Ray actors), weights over NCCL.
# Recipe: recipes/small_moe_fp8_blockwise_2gpu.yaml. DRY_RUN=1 prints the resolved plan instead of starting.
# Extra overrides pass through: ./run_small_moe_fp8_blockwise_2gpu.sh algorithm.lr=2e-6
set -euo pipefail
cd "$(dirname "$0")/../../.."
PY=${PY:-.venv/bin/python}

# NVLink multicast off (NCCL NVLS): multicast objects are not lent on shared machines.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
extra=()
[ "${DRY_RUN:-0}" = 1 ] && extra+=(dry_run=true)
exec "$PY" -m skyq.train recipe=small_moe_fp8_blockwise_2gpu \
  "${extra[@]}" "$@"
