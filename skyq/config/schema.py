"""The typed schema of a skyq run: the one home of every default.

Each field carries a one-line docstring (docs/configuration.md is generated from them).
Hydra group options (conf/<group>/<option>.yaml) only pick and override these fields.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from skyq.config.enums import (
    ArithOp,
    ComputeDtype,
    Device,
    Fp8Gemm,
    Fp8Recipe,
    Int4Grid,
    ISCorrection,
    LoggerBackend,
    ModelFamily,
    Placement,
    Precision,
    QuantScope,
    RecomputeGranularity,
    RecomputeMethod,
    RewardName,
    RolloutBackend,
    RopeScaling,
    ScaleFormat,
    TaskName,
    TrainerBackend,
    TransportKind,
    WeightSyncMode,
)

CONFIG_VERSION = 1


@dataclass(frozen=True)
class Range:
    """The values a numeric field may take: `low` and `high` bounds (None = unbounded), each
    inclusive unless `low_open` / `high_open`. Checked for every field that declares one by
    `skyq.config.validate` and listed in docs/configuration.md."""

    low: float | None = None
    """Lowest allowed value (None = unbounded below)."""
    high: float | None = None
    """Highest allowed value (None = unbounded above)."""
    low_open: bool = False
    """`low` itself is excluded."""
    high_open: bool = False
    """`high` itself is excluded."""

    def __contains__(self, value: float) -> bool:
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.high is None or (value < self.high if self.high_open else value <= self.high)

    def __str__(self) -> str:
        if self.high is None:
            return f"{'>' if self.low_open else '>='} {self.low:g}"
        if self.low is None:
            return f"{'<' if self.high_open else '<='} {self.high:g}"
        return (
            f"in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}{')' if self.high_open else ']'}"
        )


def bounded(
    default,
    *,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
):
    """A numeric field's default and its `Range` (one of ge / gt, and optionally one of le / lt)."""
    rng = Range(
        low=gt if gt is not None else ge,
        high=lt if lt is not None else le,
        low_open=gt is not None,
        high_open=lt is not None,
    )
    if default is not None and default not in rng:
        raise ValueError(f"schema: default {default!r} outside its own range {rng}")
    return field(default=default, metadata={"range": rng})


@dataclass
class PrecisionConfig:
    name: Precision = Precision.bf16
    """Precision of the run: trainer compute and rollout wire format."""
    fp8_recipe: Fp8Recipe = Fp8Recipe.auto
    """FP8 recipe; `auto` is resolved on each worker (blockwise before SM100, mxfp8 on SM100+)."""
    scale_format: ScaleFormat = ScaleFormat.fp32
    """FP8 blockwise scale format: fp32, or ue8m0 (power-of-two scales)."""
    block_size: list[int] = field(default_factory=lambda: [128, 128])
    """FP8 blockwise weight block [rows, cols]."""
    activation_tile: int = bounded(128, ge=1)
    """FP8 blockwise activation tile length along K (1 x tile)."""
    fp8_targets: QuantScope = QuantScope.all_linear
    """Linears FP8 blockwise quantizes (all_linear covers attention and experts)."""
    mxfp8_targets: QuantScope = QuantScope.routed_experts
    """Linears MXFP8 quantizes (routed_experts is the expert-only recipe)."""
    int4_group_size: int = 32
    """INT4 group size G along K (Kimi-K2.x and the tiny model 32; the Qwen3 recipes set 128)."""
    int4_grid: Int4Grid = Int4Grid.kimi
    """INT4 grid: kimi (/7, [-7,7]) or rtn (/7.5, [-8,7])."""
    qat_scope: QuantScope = QuantScope.routed_experts
    """Linears the INT4 fake-quant (QAT) covers; must equal what the rollout checkpoint quantizes."""
    emulate: bool = False
    """Allow a recipe the hardware lacks (e.g. mxfp8 before SM100) by exact emulation."""
    persistent_fp8_params: bool = False
    """Keep trainer parameters persistently in FP8 (blockwise only)."""


@dataclass(unsafe_hash=True)
class RopeScalingConfig:
    """YaRN rotary scaling, HF `rope_parameters` (transformers 5) / `rope_scaling` (older releases).
    Hashable by value: a `ModelConfig`'s field values key caches (`mapping.tables`)."""

    type: RopeScaling = RopeScaling.none
    """none = plain RoPE at `model.rope_theta`; yarn = YaRN (DeepSeek-V3, Kimi-K2.x long context)."""
    factor: float = bounded(1.0, ge=1)
    """Context extension factor (Kimi-K2.6: 64, DeepSeek-V3: 40)."""
    original_max_position_embeddings: int = bounded(4096, ge=1)
    """Context length the model was pre-trained at before the extension."""
    beta_fast: float = bounded(32.0, gt=0)
    """Rotations over the original context above which a frequency is kept unscaled (Kimi-K2.x: 1)."""
    beta_slow: float = bounded(1.0, gt=0)
    """Rotations below which a frequency is divided by `factor` (a linear ramp between the two)."""
    mscale: float = bounded(1.0, gt=0)
    """YaRN attention-temperature coefficient of the rotary cos/sin (0.1 * mscale * ln(factor) + 1)."""
    mscale_all_dim: float = bounded(0.0, ge=0)
    """Its divisor on cos/sin and, squared, the MLA softmax scale's factor (0 = DeepSeek's softmax scale unchanged)."""


@dataclass
class ModelConfig:
    name: str = "tiny_moe"
    """Model preset name."""
    family: ModelFamily = ModelFamily.qwen3_moe
    """Architecture family; selects the quantization layout."""
    vocab_size: int = bounded(32, ge=1)
    """Vocabulary size."""
    hidden_size: int = bounded(64, ge=1)
    """Hidden size."""
    num_layers: int = bounded(2, ge=1)
    """Number of decoder layers."""
    num_attention_heads: int = bounded(4, ge=1)
    """Attention heads."""
    num_key_value_heads: int = bounded(2, ge=1)
    """Key/value heads (GQA)."""
    head_dim: int = bounded(16, ge=1)
    """Per-head dimension (Qwen3 attention)."""
    intermediate_size: int = bounded(128, ge=1)
    """Dense MLP width (the leading dense layers of deepseek_v3; shared experts use moe_intermediate_size)."""
    moe_intermediate_size: int = bounded(64, ge=1)
    """Routed-expert MLP width."""
    num_experts: int = bounded(4, ge=1)
    """Routed experts per MoE layer."""
    num_experts_per_tok: int = bounded(2, ge=1)
    """Experts each token is routed to (top-k)."""
    num_shared_experts: int = bounded(0, ge=0)
    """Shared experts per MoE layer (deepseek_v3)."""
    first_k_dense_replace: int = bounded(0, ge=0)
    """Leading layers with a dense MLP instead of MoE (deepseek_v3)."""
    max_position_embeddings: int = bounded(512, ge=1)
    """Longest sequence (prompt + response) the model takes."""
    rope_theta: float = bounded(1000000.0, gt=0)
    """RoPE base."""
    rope_scaling: RopeScalingConfig = field(default_factory=RopeScalingConfig)
    """Rotary scaling (YaRN) of a long-context release."""
    rms_norm_eps: float = bounded(1e-6, gt=0)
    """RMSNorm epsilon."""
    tie_word_embeddings: bool = False
    """Share the embedding and lm_head weights."""
    q_lora_rank: Optional[int] = bounded(None, ge=1)
    """MLA query low-rank dimension (deepseek_v3; None = no q compression)."""
    kv_lora_rank: int = bounded(0, ge=0)
    """MLA key/value low-rank dimension (deepseek_v3)."""
    qk_nope_head_dim: int = bounded(0, ge=0)
    """MLA non-rotary query/key head dimension (deepseek_v3)."""
    qk_rope_head_dim: int = bounded(0, ge=0)
    """MLA rotary query/key head dimension (deepseek_v3)."""
    v_head_dim: int = bounded(0, ge=0)
    """MLA value head dimension (deepseek_v3)."""
    num_nextn_predict_layers: int = bounded(0, ge=0)
    """Multi-token-prediction layers in the checkpoint (never quantized)."""
    routed_scaling_factor: float = bounded(1.0, gt=0)
    """Factor on the routed experts' top-k weights (deepseek_v3; Kimi-K2.x: 2.827, DeepSeek-V3: 2.5)."""
    n_group: int = bounded(1, ge=1)
    """Expert groups the router picks among before its top-k (deepseek_v3; Kimi-K2.x: 1)."""
    topk_group: int = bounded(1, ge=1)
    """Expert groups each token's experts may come from (deepseek_v3; Kimi-K2.x: 1)."""
    text_prefix: str = ""
    """Prefix of text weights in the checkpoint (Kimi-K2.6: `language_model.`)."""
    vision_num_layers: int = bounded(0, ge=0)
    """Vision-tower blocks (0 = text-only model)."""
    vision_hidden_size: int = bounded(0, ge=0)
    """Vision-tower hidden size."""
    vision_intermediate_size: int = bounded(0, ge=0)
    """Vision-tower MLP width."""
    init_seed: int = bounded(0, ge=0)
    """Seed of the random init when skyq builds a tiny checkpoint itself."""
    init_sft_steps: int = bounded(100, ge=0)
    """Supervised warm-up steps on the task when skyq builds a tiny checkpoint (0 = random init)."""


@dataclass
class ParallelConfig:
    tp: int = bounded(1, ge=1)
    """Trainer tensor parallel size."""
    pp: int = bounded(1, ge=1)
    """Trainer pipeline parallel size."""
    cp: int = bounded(1, ge=1)
    """Trainer context parallel size."""
    ep: int = bounded(1, ge=1)
    """Trainer expert parallel size (must divide the expert count)."""
    etp: int = bounded(1, ge=1)
    """Trainer expert tensor parallel size."""
    dp: Optional[int] = bounded(None, ge=1)
    """Trainer data parallel size (None = trainer GPUs / (tp*pp*cp))."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism (with tp > 1)."""
    vision_dp_when_tp: bool = False
    """Run the vision tower data-parallel across the TP group."""
    first_stage_layers: Optional[int] = bounded(None, ge=1)
    """Decoder layers on the first pipeline stage (None = even split)."""
    last_stage_layers: Optional[int] = bounded(None, ge=1)
    """Decoder layers on the last pipeline stage (None = even split)."""


@dataclass
class TopologyConfig:
    name: str = "cpu"
    """Topology preset name."""
    device: Device = Device.cpu
    """Device kind the run needs."""
    num_nodes: int = bounded(1, ge=1)
    """Nodes in the cluster."""
    gpus_per_node: int = bounded(0, ge=0)
    """GPUs per node (0 on a CPU topology)."""
    placement: Placement = Placement.split
    """Trainer and rollout on the same GPUs (colocated) or on separate ones (split)."""
    trainer_gpus: int = bounded(0, ge=0)
    """GPUs the trainer uses."""
    rollout_gpus: int = bounded(0, ge=0)
    """GPUs the rollout engines use (colocated: the same GPUs as the trainer)."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Trainer parallel layout."""
    placement_timeout_s: float = bounded(600.0, gt=0)
    """Deadline for the run's placement group to be ready (and for the device probe); past it the run stops naming what it asked and what the cluster has."""


@dataclass
class WeightSyncConfig:
    mode: WeightSyncMode = WeightSyncMode.full
    """Full sync every step, or incremental (delta; bf16 only)."""
    transport: TransportKind = TransportKind.auto
    """How buckets move: auto (in_process when trainer and engine share one GPU, else broadcast), in_process, broadcast (gloo/NCCL), cuda_ipc."""
    bucket_bytes: int = bounded(64 * 1024 * 1024, ge=1)
    """Target bytes per bucket."""
    timeout_s: float = bounded(120.0, gt=0)
    """Deadline for every wait of a sync."""
    worker_call_timeout_s: float = bounded(1800.0, gt=0)
    """Deadline for each other call the driver makes into the trainer or the engine (start-up, generate, train_step, a checkpoint save or load, a whole sync); past it the run stops naming the worker and the call."""
    verify_checksum: bool = True
    """Receiver checks the manifest checksum of every bucket."""


@dataclass
class RolloutConfig:
    backend: RolloutBackend = RolloutBackend.embedded
    """Rollout engine backend."""
    gpus_per_engine: int = bounded(1, ge=1)
    """GPUs per rollout engine."""
    num_engines: Optional[int] = bounded(None, ge=1)
    """Rollout engines the run starts, each synced and verified every step (None: topology.rollout_gpus / gpus_per_engine on GPUs, 1 on the CPU)."""
    tp_size: Optional[int] = bounded(None, ge=1)
    """Engine tensor parallel size (None = gpus_per_engine)."""
    dp_size: int = bounded(1, ge=1)
    """Engine attention data parallel size."""
    ep_size: int = bounded(1, ge=1)
    """Engine expert parallel size."""
    gpu_memory_fraction: float = bounded(0.7, gt=0, le=1)
    """Fraction of GPU memory the engine may take."""
    max_model_len: Optional[int] = bounded(None, ge=1)
    """vLLM: longest prompt + response an engine serves (None: model.max_position_embeddings)."""
    max_num_seqs: int = bounded(64, ge=1)
    """vLLM: sequences an engine decodes together."""
    kv_cache_bytes: Optional[int] = bounded(None, ge=1)
    """vLLM: KV-cache size in bytes (None: gpu_memory_fraction of the device; on a CPU, of host memory)."""
    enforce_eager: bool = True
    """vLLM: run eagerly (no torch.compile, no CUDA graphs): boots in seconds; false for decode speed."""
    engine_core_process: bool = False
    """vLLM: run the engine core in a child process of the engine actor (V1 multiprocessing: scheduling overlaps the forward); false: in the actor's own process."""
    temperature: float = bounded(1.0, gt=0)
    """Sampling temperature."""
    top_p: float = bounded(1.0, gt=0, le=1)
    """Nucleus sampling threshold."""
    cuda_graphs: bool = True
    """Embedded engine on a GPU: replay its decode step from a CUDA graph (false: every step eager)."""
    fp8_codes_decode: bool = True
    """Embedded engine, FP8 blockwise on an sm_89+ GPU: large decode steps multiply activation codes by weight codes (faster; false: the trainer's bf16 values)."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment variables for engine processes."""
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    """Trainer -> engine weight sync."""


@dataclass
class OptimizerConfig:
    weight_decay: float = bounded(0.0, ge=0)
    """AdamW weight decay."""
    adam_beta1: float = bounded(0.9, ge=0, lt=1)
    """Adam beta1."""
    adam_beta2: float = bounded(0.98, ge=0, lt=1)
    """Adam beta2."""
    adam_eps: float = bounded(1e-8, gt=0)
    """Adam epsilon."""
    grad_clip: float = bounded(1.0, gt=0)
    """Max global gradient norm."""
    lr_warmup_steps: int = bounded(0, ge=0)
    """Linear learning-rate warm-up steps."""
    cpu_offload: bool = False
    """Keep optimizer state (fp32 master weights and moments) on the CPU; needs precision_aware."""
    overlap_cpu_offload: bool = False
    """Overlap the optimizer's D2H/H2D copies with compute (with cpu_offload)."""
    precision_aware: bool = False
    """Precision-aware optimizer (low-precision moments, fp32 master weights)."""


@dataclass
class RecomputeConfig:
    granularity: RecomputeGranularity = RecomputeGranularity.none
    """Activation recompute granularity."""
    method: RecomputeMethod = RecomputeMethod.uniform
    """How recomputed layers are chosen."""
    num_layers: int = bounded(1, ge=1)
    """Layers per recompute unit."""


@dataclass
class TrainerConfig:
    backend: TrainerBackend = TrainerBackend.torch
    """Trainer backend."""
    micro_batch_size: int = bounded(128, ge=1)
    """Sequences per forward/backward micro-batch."""
    compute_dtype: ComputeDtype = ComputeDtype.bf16
    """Torch trainer forward/backward dtype: bf16 (the rollout engine's activations, so trainer and engine compute the same function; fp32 master weights and optimizer) or fp32."""
    fp8_gemm: Fp8Gemm = Fp8Gemm.off
    """precision=fp8_blockwise, torch trainer: off (fake quant, fp32 GEMMs), auto (cuBLAS blockwise FP8 GEMMs on SM90, else off), emulated."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """Optimizer."""
    recompute: RecomputeConfig = field(default_factory=RecomputeConfig)
    """Activation recompute."""
    moe_token_dispatcher: str = "alltoall"
    """Megatron MoE token dispatcher (alltoall, flex for DeepEP)."""
    deepep_max_dispatch_tokens: int = bounded(0, ge=0)
    """DeepEP dispatch tokens per rank (0 = DeepEP off)."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment variables for trainer processes."""


@dataclass
class AlgorithmConfig:
    name: str = "grpo"
    """RL algorithm."""
    num_steps: int = bounded(120, ge=1)
    """Training steps (one rollout batch and one update each)."""
    group_size: int = bounded(8, ge=2)
    """Responses sampled per prompt."""
    global_batch_size: int = bounded(256, ge=1)
    """Responses per training step (prompts x group_size)."""
    lr: float = bounded(3e-3, gt=0)
    """Learning rate."""
    kl_coef: float = bounded(0.0, ge=0)
    """Weight of the KL-to-reference loss (0 = no reference model)."""
    clip_eps_low: float = bounded(0.2, gt=0, lt=1)
    """PPO clip lower epsilon."""
    clip_eps_high: float = bounded(0.28, gt=0)
    """PPO clip upper epsilon."""
    normalize_adv_std: bool = True
    """Divide group advantages by the group's std."""
    is_correction: ISCorrection = ISCorrection.tis
    """Importance-sampling correction for train/rollout mismatch."""
    is_cap: float = 2.0
    """TIS: cap on the token importance ratio."""
    is_low: float = 0.5
    """icepop: tokens with ratio below this are masked."""
    is_high: float = 2.0
    """icepop: tokens with ratio above this are masked."""
    max_mismatch: float = 0.5
    """Stop the run when the train/rollout mismatch (mean abs logp difference per token) exceeds this for mismatch_patience consecutive steps (0 = never); healthy runs sit at 0.0002-0.01."""
    mismatch_patience: int = 3
    """Consecutive steps over algorithm.max_mismatch before the run stops."""


@dataclass
class EvalConfig:
    dataset: Optional[str] = None
    """Eval dataset: a local .jsonl or .parquet file (None = the task's built-in eval set; only arith has one)."""
    prompt_key: Optional[str] = None
    """Eval dataset key of the prompt (None = task.prompt_key)."""
    label_key: Optional[str] = None
    """Eval dataset key of the reference answer (None = task.label_key)."""
    interval: int = bounded(0, ge=0)
    """Evaluate every N steps (0 = never): before the step's rollout, on the weights of the updates so far (step 0: the starting model)."""
    num_samples: int = bounded(1, ge=1)
    """Samples per eval prompt."""
    temperature: float = bounded(0.0, ge=0)
    """Eval sampling temperature (0 = greedy); top_p is rollout.top_p."""


@dataclass
class TaskConfig:
    name: TaskName = TaskName.arith
    """Task."""
    dataset: Optional[str] = None
    """Training dataset: a local .jsonl or .parquet file (None = the task's built-in generator; arith only)."""
    reward: RewardName = RewardName.exact_match
    """Reward function."""
    prompt_key: str = "prompt"
    """Dataset key of the prompt."""
    label_key: str = "label"
    """Dataset key of the reference answer (dotted for a struct field: reward_model.ground_truth)."""
    image_key: Optional[str] = None
    """Dataset key of images (multimodal tasks)."""
    max_image_tokens: int = bounded(0, ge=0)
    """Image-token budget per sample (multimodal tasks)."""
    apply_chat_template: bool = False
    """Wrap prompts with the tokenizer's chat template."""
    max_prompt_length: int = bounded(8, ge=1)
    """Longest prompt in tokens."""
    max_response_length: int = bounded(4, ge=1)
    """Longest response in tokens."""
    arith_op: ArithOp = ArithOp.add_mod10
    """arith task: the operation the model must learn."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Evaluation."""


@dataclass
class LoggerConfig:
    backend: LoggerBackend = LoggerBackend.jsonl
    """Metrics sink (JSONL is always written; wandb in addition when chosen)."""
    project: str = "skyq"
    """wandb project."""
    wandb_mode: str = "offline"
    """wandb mode: online, offline or disabled."""
    progress_bar: bool = True
    """Show a progress bar."""
    plot: bool = True
    """Write a PNG plot of reward and mismatch at the end of the run."""


@dataclass
class CheckpointConfig:
    hf_checkpoint: Optional[str] = None
    """BF16 HF checkpoint the trainer starts from (None for tiny models: built and cached)."""
    rollout_checkpoint: Optional[str] = None
    """Checkpoint the rollout engines boot from (quantized for fp8/mxfp8/int4 precisions)."""
    ref_load: Optional[str] = None
    """Reference-model checkpoint for the KL term (BF16)."""
    load: Optional[str] = None
    """Trainer checkpoint to resume from (Megatron/torch format)."""
    save: Optional[str] = None
    """Where trainer checkpoints go (None = <run dir>/checkpoints)."""
    save_interval: int = bounded(20, ge=0)
    """Save a checkpoint every N steps (0 = only at the end)."""
    async_save: bool = True
    """Write trainer.pt in the background from a CPU snapshot while the run goes on (false: block)."""
    cache_dir: str = ".skyq_cache"
    """Where skyq keeps tiny checkpoints it builds itself."""


@dataclass
class TrainConfig:
    config_version: int = CONFIG_VERSION
    """Schema version written into skyq_config.json."""
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    """Precision."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """Model."""
    topology: TopologyConfig = field(default_factory=TopologyConfig)
    """Hardware and placement."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """RL algorithm."""
    task: TaskConfig = field(default_factory=TaskConfig)
    """Task and data."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Rollout engines."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """Trainer."""
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    """Logging."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoint paths."""
    seed: int = bounded(0, ge=0)
    """Global seed (data order, sampling, init)."""
    dry_run: bool = False
    """Print the resolved plan and exit without touching a GPU."""
    simulate: bool = False
    """Run the placement plan on a logical Ray cluster of the topology's GPUs with stand-in workers (no GPU), check it and print it."""
    resume: Optional[str] = None
    """Run directory to resume (continues at its last checkpoint)."""
    output_root: str = "runs"
    """Parent directory of run directories."""
