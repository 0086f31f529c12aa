"""Make megatron-core run on a torch without CUDA: the few `torch.cuda` calls it makes unconditionally.

Why this lives in skyq/ and not tests/: `python -m skyq.train trainer=megatron` must run on the CPU
in CI (tiny models over gloo), so the Megatron worker process itself calls `apply()` before it builds
a model. It is called only inside a Megatron worker process, never in the driver (`import skyq` stays
light), and it is a no-op on a CUDA torch.

Each patch names the megatron-core version that needs it (0.16.1, the CPU pin) and what calls it:

- `torch.cuda.current_device` -> `torch.device("cpu")`. 0.16.1 passes `device=torch.cuda.current_device()`
  when it allocates: `RotaryEmbedding.get_emb` / `forward` (rotary_pos_embedding.py), the router's
  aux-loss tensors (moe/router.py), `tensor_parallel.mappings` / `layers` gather buffers (TP/SP),
  `attention.py` KV buffers, DDP's grad buffers (distributed/param_and_grad_buffer.py).
- `torch.cuda.Stream` / `current_stream` / `stream` / `Event` -> one CPU stream whose events are
  complete at once. 0.16.1's `MoEAlltoAllTokenDispatcher.__init__` creates a D2H side stream and
  `_maybe_dtoh_and_synchronize` waits on it and records an event on every forward; the shared
  expert overlap (moe/shared_experts.py) uses a stream too. On the CPU every op is synchronous, so
  a stream with nothing to wait for is exact.
- The "CUDA" RNG state -> a dedicated CPU `torch.Generator`. 0.16.1's `CudaRNGStatesTracker.add`
  (called by `model_parallel_cuda_manual_seed`) reads and seeds `torch.cuda`'s generator, its `fork`
  (entered on every forward: `DotProductAttention`, the embedding, expert init) and activation
  recompute (`tensor_parallel.random.CheckpointFunction`, `_get_all_rng_states`) save and restore
  it through `tensor_parallel.random._get_cuda_rng_state` / `_set_cuda_rng_state`. On the CPU those
  read and write the stand-in generator, so the tracker's bookkeeping holds; CPU ops themselves draw
  from the CPU default generator (skyq runs Megatron with dropout 0; CPU init is
  `use_cpu_initialization`, which draws from the default generator).
- `get_default_causal_mask` -> the same mask on the CPU. 0.16.1's `transformer/utils.py` builds it
  with `device="cuda"`; `FusedScaleMaskSoftmax.forward_torch_softmax` (fused_softmax.py, imported by
  name there) calls it whenever the causal attention gets no explicit mask.
- `maybe_move_tensor_to_cpu` -> the same, but a CPU tensor asked for `as_numpy` becomes a numpy
  array too. 0.16.1 (moe_utils.py, imported by name into token_dispatcher.py) converts only CUDA
  tensors, so on the CPU `MoEAlltoAllTokenDispatcher` hands its split sizes to
  `torch.distributed.all_to_all_single` as tensors, which torch 2.13 rejects (TypeError): EP > 1
  with the alltoall dispatcher cannot run.
- `moe_utils.te_general_gemm = None` where Transformer Engine is absent (it always is on the CPU).
  0.16.1's `RouterGatingLinearFunction` tests `te_general_gemm is not None`, but the name is bound
  only by the `import transformer_engine` that failed, so every MoE router raises NameError.
- `multi_latent_attention.HAVE_TE = False` where Transformer Engine is absent. 0.16.1 sets it from
  importing `megatron.core.extensions.transformer_engine`, which succeeds without TE (it stands in
  a MagicMock for `te`), so `MLASelfAttention.__init__` runs `isinstance(linear_proj, TELinear)`
  with a MagicMock and raises TypeError: no MLA model builds.
- `pipeline_parallel.schedules.torch` -> `CpuAllocatingTorch`. 0.16.1's schedules (every one of
  them, `forward_backward_pipelining_without_interleaving` included) start with
  `total_num_tokens = torch.zeros([], dtype=torch.int, device="cuda")`: no pipeline schedule runs.
- `torch.cuda.synchronize` -> a no-op. 0.16.1's `P2PCommunicator._communicate` calls it after
  every batched send / receive between pipeline stages (`batch_p2p_comm` and `batch_p2p_sync`,
  both on by default; gloo's `batch_isend_irecv` itself works), and dist-checkpointing's save and
  load call it; every CPU op is synchronous.
- `LanguageModule.setup_embeddings_and_output_layer` runs with `Tensor.cuda` returning the tensor
  itself. With tied embeddings and pp > 1, 0.16.1 copies the first stage's embedding into the last
  stage's output layer by `weight.data = weight.data.cuda()` and an all-reduce over the embedding
  group: on the CPU that line raised, so no tied model built in a pipeline. Only inside that call.
- `DistributedOptimizer.state_dict` of an optimizer holding no parameter. 0.16.1 gives every rank
  the same parameter groups (`_get_param_groups` gathers their keys over the world), so a pipeline
  stage without routed experts (DeepSeek-V3's dense first layers, PP2 x EP2 of the tiny MLA model)
  still gets an expert optimizer, with empty groups. Without Apex or Transformer Engine (always on
  the CPU) `state_dict` reads the Adam step from the per-parameter state and asserts there is
  exactly one value: with no parameter there is none, so every checkpoint save (and load, which
  calls it too) of such a stage raised AssertionError. Here that optimizer's state is its groups'
  settings with step 0 (the per-parameter state it would restore is empty); any optimizer holding a
  parameter goes through 0.16.1's own method.
"""

from __future__ import annotations

import contextlib
import types
from typing import Any

import torch

_APPLIED = False


class CpuEvent:
    """A CUDA event stand-in: every event is complete when recorded (CPU ops are synchronous)."""

    def record(self, stream=None) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def wait(self, stream=None) -> None:
        return None

    def query(self) -> bool:
        return True


class CpuStream:
    """A CUDA stream stand-in for the CPU: nothing is ever pending on it."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def wait_stream(self, stream) -> None:
        return None

    def wait_event(self, event) -> None:
        return None

    def record_event(self, event=None) -> CpuEvent:
        return event if event is not None else CpuEvent()

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


_CURRENT_STREAM = CpuStream()
_RNG = torch.Generator()


def _current_stream(device=None) -> CpuStream:
    return _CURRENT_STREAM


def _stream(stream=None):
    return contextlib.nullcontext(stream)


def _current_device() -> torch.device:
    return torch.device("cpu")


def _get_rng_state(device="cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    return _RNG.get_state()


def _set_rng_state(new_state: torch.Tensor, device=-1, graph_safe: bool = False) -> None:
    _RNG.set_state(new_state)


def _manual_seed(seed: int) -> None:
    _RNG.manual_seed(int(seed))


def _default_causal_mask(sq: int) -> torch.Tensor:
    return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)


def _move_to_cpu(tensor, as_numpy: bool = False, record_stream: bool = False):
    if torch.is_tensor(tensor):
        tensor = tensor.cpu()
        if as_numpy:
            return tensor.numpy()
    return tensor


def _on_cpu(factory: Any) -> Any:
    def make(*args: Any, **kwargs: Any) -> Any:
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cuda":
            kwargs["device"] = "cpu"
        return factory(*args, **kwargs)

    return make


class CpuAllocatingTorch(types.ModuleType):
    """`torch` as a megatron module that allocates on "cuda" unconditionally sees it on the CPU:
    its tensor factories put such tensors on the CPU; everything else is torch's."""

    def __init__(self) -> None:
        super().__init__("torch")
        for name in ("tensor", "zeros", "ones", "empty", "full"):
            setattr(self, name, _on_cpu(getattr(torch, name)))

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def _synchronize(device=None) -> None:
    return None


def _tensor_itself(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    return self


def _with_cpu_tensor_cuda(method: Any) -> Any:
    """`method` with `torch.Tensor.cuda` returning the tensor itself while it runs."""

    def run(*args: Any, **kwargs: Any) -> Any:
        saved = torch.Tensor.cuda
        torch.Tensor.cuda = _tensor_itself
        try:
            return method(*args, **kwargs)
        finally:
            torch.Tensor.cuda = saved

    return run


def _without_parameters_too(state_dict: Any) -> Any:
    """`DistributedOptimizer.state_dict` that also answers for an optimizer holding no parameter."""

    def run(self: Any) -> dict:
        if any(group["params"] for group in self.optimizer.param_groups):
            return state_dict(self)
        inner = self.optimizer.state_dict()
        groups = [
            {**{k: v for k, v in group.items() if k != "params"}, "step": 0}
            for group in inner["param_groups"]
        ]
        out: dict = {
            "optimizer": {**{k: v for k, v in inner.items() if k != "state"}, "param_groups": groups}
        }
        if self.grad_scaler:
            out["grad_scaler"] = self.grad_scaler.state_dict()
        return out

    return run


def _have_te() -> bool:
    import importlib.util

    return importlib.util.find_spec("transformer_engine") is not None


def apply() -> None:
    """Install the CPU stand-ins (idempotent; a no-op when torch has CUDA)."""
    global _APPLIED
    if _APPLIED or torch.cuda.is_available():
        return
    from megatron.core.fusions import fused_softmax
    from megatron.core.models.common.language_module.language_module import LanguageModule
    from megatron.core.optimizer import distrib_optimizer
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.tensor_parallel import random as mcore_random
    from megatron.core.transformer import multi_latent_attention
    from megatron.core.transformer import utils as mcore_utils
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    torch.cuda.current_device = _current_device
    torch.cuda.Stream = CpuStream
    torch.cuda.Event = CpuEvent
    torch.cuda.current_stream = _current_stream
    torch.cuda.stream = _stream
    torch.cuda.get_rng_state = _get_rng_state
    torch.cuda.random.get_rng_state = _get_rng_state
    torch.cuda.set_rng_state = _set_rng_state
    torch.cuda.manual_seed = _manual_seed
    torch.cuda.synchronize = _synchronize
    mcore_random._get_cuda_rng_state = _get_rng_state
    mcore_random._set_cuda_rng_state = _set_rng_state
    mcore_utils.get_default_causal_mask = _default_causal_mask
    fused_softmax.get_default_causal_mask = _default_causal_mask
    moe_utils.maybe_move_tensor_to_cpu = _move_to_cpu
    token_dispatcher.maybe_move_tensor_to_cpu = _move_to_cpu
    schedules.torch = CpuAllocatingTorch()
    LanguageModule.setup_embeddings_and_output_layer = _with_cpu_tensor_cuda(
        LanguageModule.setup_embeddings_and_output_layer
    )
    if not distrib_optimizer.HAVE_APEX_OR_TE:  # with them, 0.16.1 reads the step off the groups
        optimizer = distrib_optimizer.DistributedOptimizer
        optimizer.state_dict = _without_parameters_too(optimizer.state_dict)
    if not _have_te():
        if not hasattr(moe_utils, "te_general_gemm"):
            moe_utils.te_general_gemm = None
        multi_latent_attention.HAVE_TE = False
    _APPLIED = True
