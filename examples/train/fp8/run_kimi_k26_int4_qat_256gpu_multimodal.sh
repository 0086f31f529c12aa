#!/usr/bin/env bash
# Kimi-K2.6 INT4 QAT, 256 GPUs (32 x 8) colocated: multimodal GRPO on multimodal-open-r1-8k-verified (openr1mm reward), images under key
# `images` with 256 image tokens, prompt 2048 / response 4096, global batch 512, lr 5e-6, vision tower DP.
# Trainer TP8 PP8 CP4 EP32 ETP1 (first/last pipeline stages hold 1/6 of the 61 layers), 16 engines of
# 16 GPUs with DP 16 / EP 16, Adam with CPU offload + overlapped copies + precision-aware optimizer,
# full uniform recompute of 1 layer, DeepEP with 256 dispatch tokens. The engines boot from the
# W4A16 (group 32, symmetric, kimi grid) release; trainer and reference start from its BF16 cast.
# Recipe: recipes/kimi_k26_int4_qat_256gpu_multimodal.yaml. DRY_RUN=1 prints the resolved plan instead of starting.
# Extra overrides pass through: ./run_kimi_k26_int4_qat_256gpu_multimodal.sh algorithm.lr=2e-6
set -euo pipefail
cd "$(dirname "$0")/../../.."
PY=${PY:-.venv/bin/python}
HF_CKPT=${HF_CKPT:-/models/Kimi-K2.6-bf16}
ROLLOUT_CKPT=${ROLLOUT_CKPT:-/models/Kimi-K2.6}
REF_CKPT=${REF_CKPT:-$HF_CKPT}
# NVLink multicast off (NCCL NVLS): multicast objects are not lent on shared machines.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
extra=()
[ "${DRY_RUN:-0}" = 1 ] && extra+=(dry_run=true)
exec "$PY" -m skyq.train recipe=kimi_k26_int4_qat_256gpu_multimodal \
  checkpoint.hf_checkpoint="$HF_CKPT" checkpoint.rollout_checkpoint="$ROLLOUT_CKPT" checkpoint.ref_load="$REF_CKPT" \
  "${extra[@]}" "$@"
