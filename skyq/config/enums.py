"""Every choice in a skyq configuration is one of these enums."""

from __future__ import annotations

from enum import Enum


class _Choice(str, Enum):
    """A config choice; prints as its value (`fp8_blockwise`, not `Precision.fp8_blockwise`)."""

    def __str__(self) -> str:
        return str(self.value)


class Precision(_Choice):
    """The precision of a run: what the trainer computes in and what crosses the wire."""

    bf16 = "bf16"
    fp8_blockwise = "fp8_blockwise"
    mxfp8 = "mxfp8"
    int4_qat = "int4_qat"


class Fp8Recipe(_Choice):
    """FP8 recipe; `auto` is resolved on each worker from its own device."""

    auto = "auto"
    blockwise = "blockwise"
    mxfp8 = "mxfp8"


class ScaleFormat(_Choice):
    """How FP8 blockwise scales are stored: plain fp32 or power-of-two (ue8m0)."""

    fp32 = "fp32"
    ue8m0 = "ue8m0"


class Int4Grid(_Choice):
    """INT4 quantization grid: `kimi` (/7, codes [-7,7]) or `rtn` (/7.5, codes [-8,7])."""

    kimi = "kimi"
    rtn = "rtn"


class QuantScope(_Choice):
    """Which linears a precision quantizes."""

    routed_experts = "routed_experts"
    all_linear = "all_linear"


class ModelFamily(_Choice):
    """Architecture family; picks the ModelQuantizationLayout."""

    qwen3_moe = "qwen3_moe"
    deepseek_v3 = "deepseek_v3"


class RopeScaling(_Choice):
    """Rotary scaling of a long-context release (HF `rope_parameters.rope_type`)."""

    none = "none"
    yarn = "yarn"


class Placement(_Choice):
    """Trainer and rollout engines on the same GPUs (colocated) or on separate ones (split)."""

    colocated = "colocated"
    split = "split"


class TrainerBackend(_Choice):
    torch = "torch"
    megatron = "megatron"


class RolloutBackend(_Choice):
    embedded = "embedded"
    vllm = "vllm"


class LoggerBackend(_Choice):
    jsonl = "jsonl"
    wandb = "wandb"


class TaskName(_Choice):
    arith = "arith"
    dapo_math = "dapo_math"
    multimodal_open_r1 = "multimodal_open_r1"


class RewardName(_Choice):
    """Reward function: exact match for arith, boxed-answer math, or openr1mm (format + accuracy)."""

    exact_match = "exact_match"
    math = "math"
    openr1mm = "openr1mm"


class Device(_Choice):
    cpu = "cpu"
    cuda = "cuda"


class WeightSyncMode(_Choice):
    """Full weight sync every step, or incremental (delta) sync (bf16 only)."""

    full = "full"
    delta = "delta"


class TransportKind(_Choice):
    """How weight buckets move: same process, torch.distributed broadcast, or CUDA IPC (auto: by placement)."""

    auto = "auto"
    in_process = "in_process"
    broadcast = "broadcast"
    cuda_ipc = "cuda_ipc"


class ComputeDtype(_Choice):
    """The dtype the native trainer's forward and backward compute in (master weights stay fp32)."""

    fp32 = "fp32"
    """Effective weights and activations in fp32."""
    bf16 = "bf16"
    """Effective weights cast to bf16, so activations, norms and the residual stream are bf16 as in
    the rollout engine; gradients reach the fp32 master through the cast."""


class Fp8Gemm(_Choice):
    """How the native trainer runs the GEMMs of FP8 blockwise linears."""

    auto = "auto"
    """cuBLAS blockwise FP8 (forward, dgrad, wgrad) where the worker's GPU has it (SM90), else `off`."""
    emulated = "emulated"
    """The same FP8 operands multiplied in fp32 on any device (exact emulation; tests and CPU)."""
    off = "off"
    """Fake quantization only: weights and inputs rounded to FP8, GEMMs and gradients in fp32."""


class RecomputeGranularity(_Choice):
    none = "none"
    selective = "selective"
    full = "full"


class RecomputeMethod(_Choice):
    uniform = "uniform"
    block = "block"


class ISCorrection(_Choice):
    """Importance-sampling correction for train/rollout mismatch."""

    none = "none"
    tis = "tis"  # truncated importance sampling, token level
    icepop = "icepop"  # mask tokens whose ratio leaves [low, high]


class ArithOp(_Choice):
    """The embedded arith task's operation."""

    copy = "copy"
    add_mod10 = "add_mod10"
