#!/usr/bin/env bash
# Qwen3-30B-A3B GRPO on DAPO-Math with MXFP8 routed experts (trainer and rollout), one 8-GPU
# Blackwell node colocated; each engine is one GPU with all experts (EP in the trainer).
# Recipe: recipes/qwen3_30b_mxfp8_8gpu.yaml. DRY_RUN=1 prints the resolved plan instead of starting.
# Extra overrides pass through: ./run_qwen3_30b_mxfp8_8gpu.sh algorithm.lr=2e-6
set -euo pipefail
cd "$(dirname "$0")/../../.."
PY=${PY:-.venv/bin/python}
HF_CKPT=${HF_CKPT:-/models/Qwen3-30B-A3B}
ROLLOUT_CKPT=${ROLLOUT_CKPT:-/models/Qwen3-30B-A3B-MXFP8}
REF_CKPT=${REF_CKPT:-$HF_CKPT}
# NVLink multicast off (NCCL NVLS): multicast objects are not lent on shared machines.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
extra=()
[ "${DRY_RUN:-0}" = 1 ] && extra+=(dry_run=true)
exec "$PY" -m skyq.train recipe=qwen3_30b_mxfp8_8gpu \
  checkpoint.hf_checkpoint="$HF_CKPT" checkpoint.rollout_checkpoint="$ROLLOUT_CKPT" checkpoint.ref_load="$REF_CKPT" \
  "${extra[@]}" "$@"
