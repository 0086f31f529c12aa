"""EmbeddedEngine: an in-process rollout engine that holds its weights in the wire format.

It is the transformers causal LM of the model's family (Qwen3-MoE, or DeepSeek-V3 with its MLA
attention, shared expert, dense first layers and fp32 router bias) with every quantized linear
replaced by a `WireLinear` (buffers = the wire tensors) and every fused experts block by per-expert
modules named like the HF tensors, under the checkpoint's text prefix (`TextPrefixed`: Kimi-K2.6's
`language_model.`), so `model.state_dict()` has exactly the plan's wire names, shapes and dtypes. Weights change
only through `load_weights`, which validates the complete set against the plan before touching
anything and bumps the weight version only after it has copied everything in.

The engine computes in bf16, like a serving engine; the trainer's fp32 compute on the same weights
is what the mismatch metrics measure against. KV cache contents live inside one `generate` call
only, so no cached state can survive a weight update. DeepSeek-V3's cache is transformers' MLA cache:
per layer and position the compressed latent (`kv_lora_rank`) and the rotated shared key
(`qk_rope_head_dim`), expanded into every head's key and value at each forward. On a GPU the decode loop replays a CUDA graph
of its one-token step over a fixed-capacity cache (`skyq.rollout.decoding`; `cuda_graphs=False`
launches every step eagerly over transformers' growing cache, as on CPU).

Kimi-K2.6's vision tower and projector (`model.vision_num_layers` > 0) sit beside the text model under
their checkpoint names, bf16 in every precision and loaded with every sync; a multimodal prompt (an
`ImagePrompt`) is prefilled with its images' embeddings in place of its placeholder tokens and then decoded
like any other.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
from collections import OrderedDict
from pathlib import Path

import torch
from torch import Tensor, nn

from skyq import ops
from skyq.checkpoint.hf_config import causal_lm_class, hf_config
from skyq.config.enums import ModelFamily, Precision
from skyq.config.schema import ModelConfig, PrecisionConfig
from skyq.quant import int4
from skyq.quant.errors import QuantizationError
from skyq.quant.fake_quant import activation_fake_quant
from skyq.quant.kernels import _common, dispatch
from skyq.quant.layouts import get_layout, vision
from skyq.quant.plan import ParamPlan, build_plan
from skyq.quant.strategies import WireSpec, get_strategy
from skyq.rl.batch import FinishReason, PromptImages, Sample, images_of
from skyq.rl.tokenizer import EOS_ID
from skyq.rollout.decoding import DynamicDecoder, StaticDecoder, cache_capacity, padded_batch
from skyq.rollout.quantized_linear import (
    ExpertMLP,
    SharedInput,
    WireExperts,
    WireLinear,
    decode_step,
    decodes_in_kernel,
    plain_linear,
    rows_stackable,
)
from skyq.rollout.sampling import check_sampling_args, draw_uniforms, sample_tokens
from skyq.sync.wire_state import WireCopier, WireState

NO_WEIGHTS = -1
DECODERS_KEPT = 4
"""Fixed-capacity decoders (a KV cache, and on CUDA a captured step) the engine keeps, most recent first."""
DECODER_CACHE_FRACTION = 0.25
"""On CUDA the kept decoders' KV caches hold at most this fraction of the device's memory (the least
recently used dropped first; the one in use always stays)."""
_QKV = ("q_proj", "k_proj", "v_proj")
"""An attention block's projections of one input (`SharedInput`)."""
_SHARED_SUFFIXES = frozenset({"weight_shape"})
"""Wire tensors that describe a matrix rather than hold it (int4's [N, K]): one per stack, not stacked."""


def sampling_seed(engine_seed: int, call_seed: int) -> int:
    """One generator seed from the engine's and the call's: engines of one run given the same call
    seed still draw different samples, and a (engine seed, call seed) pair always draws the same."""
    digest = hashlib.sha256(f"skyq-engine:{engine_seed}:{call_seed}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & 0x7FFF_FFFF_FFFF_FFFF


@functools.cache
def _cache_kwarg(model_cls: type) -> str:
    """The forward argument that takes the KV cache: `cache` in newer transformers, `past_key_values`
    before (an unknown keyword would be swallowed by **kwargs and the cache silently unused)."""
    params = inspect.signature(model_cls.forward).parameters
    for name in ("cache", "past_key_values"):
        if name in params:
            return name
    raise RuntimeError(f"{model_cls.__name__}.forward takes neither `cache` nor `past_key_values`")


class WeightLoadError(ValueError):
    """A weight update that does not match the plan; the engine keeps its previous weights."""


class EmbeddedEngine:
    """Batched sampling with log-probs from wire-format weights (see the module docstring)."""

    def __init__(
        self,
        *,
        model_cfg: ModelConfig,
        precision_cfg: PrecisionConfig,
        device: str = "cpu",
        seed: int,
        eos_token_id: int = EOS_ID,
        cuda_graphs: bool = True,
        fp8_codes_decode: bool = True,
    ) -> None:
        self.model_cfg, self.precision_cfg = model_cfg, precision_cfg
        self.device = torch.device(device)
        self.seed = seed
        self.eos_token_id = eos_token_id
        self.plan = build_plan(model_cfg, precision_cfg)
        self.strategy = get_strategy(precision_cfg)
        self.layout = get_layout(model_cfg.family)
        self.expected: dict[str, WireSpec] = {w.name: w for p in self.plan for w in p.wire}
        self.model = self._build_model().to(self.device).eval()
        for module in self.model.modules():  # experts as one tensor a projection (grouped decode)
            if isinstance(module, WireLinear):
                module.codes_decode = fp8_codes_decode  # `rollout.fp8_codes_decode`
            if isinstance(module, WireExperts):
                module.stack()
            elif all(isinstance(getattr(module, p, None), nn.Module) for p in _QKV):
                qkv = [getattr(module, p) for p in _QKV]
                if rows_stackable(qkv):  # q, k and v in one launch at decode sizes
                    SharedInput(qkv)
        self._version = NO_WEIGHTS
        self._held = self.model.state_dict()  # the live tensors load_weights copies into
        self._copier = WireCopier(self._held)
        held = {name: (tuple(t.shape), t.dtype) for name, t in self._held.items()}
        assert held == {n: (w.shape, w.dtype) for n, w in self.expected.items()}, "engine model != plan"
        self._stack_groups = self._stack_groups_of_plan()
        self.decode_mode = "graph" if cuda_graphs and self.device.type == "cuda" else "dynamic"
        """How `generate` decodes: "graph" (CUDA: a fixed-capacity cache, the one-token step captured
        once per batch and capacity and replayed where `_step_capturable`, else eager over the same
        cache), "static" (the same cache and rows, every step eager: what a graph replays, for tests
        and debugging) or "dynamic" (transformers' growing cache, eager: CPU, or `cuda_graphs=False`)."""
        self._decoders: OrderedDict[tuple[int, int], StaticDecoder] = OrderedDict()

    # construction -------------------------------------------------------------------------------

    def _linear(self, hf_name: str) -> nn.Module:
        entry = self.plan[hf_name]
        if entry.quantized:
            activation = activation_fake_quant(self.precision_cfg)
            return WireLinear(hf_name, entry.role, list(entry.wire), self.strategy, activation)
        return plain_linear(entry.shape, entry.dtype)

    def _build_model(self) -> nn.Module:
        """The transformers model with wire-format linears, every held tensor allocated as the plan says."""
        with torch.device("meta"):  # nothing of the stock model is kept: skip allocating and initializing it
            lm = causal_lm_class(self.model_cfg)(hf_config(self.model_cfg))
        ops.install(lm)  # the trainer's norm, rotary and router kernels (same bits on a GPU)
        prefix = self.model_cfg.text_prefix
        model = TextPrefixed(prefix, lm, model_cfg=self.model_cfg) if prefix else lm
        for name, module in list(model.named_modules()):
            if vision.is_vision_name(name + "."):  # bf16 in every precision: the tower's own modules
                continue
            if isinstance(module, nn.Linear) and f"{name}.weight" in self.plan:
                self._replace(model, name, self._linear(f"{name}.weight"))
            elif isinstance(getattr(module, "gate_up_proj", None), Tensor):
                experts = [
                    ExpertMLP(*(self._linear(f"{name}.{e}.{p}.weight") for p in ("gate_proj", "up_proj", "down_proj")),
                              act_fn=module.act_fn)
                    for e in range(self.model_cfg.num_experts)
                ]  # fmt: skip
                self._replace(model, name, WireExperts(experts))
        model.to_empty(device="cpu")
        for spec in self.expected.values():  # zero storage of exactly the plan's shape and dtype
            holder, _, leaf = spec.name.rpartition(".")
            owner = model.get_submodule(holder)
            tensor = torch.zeros(spec.shape, dtype=spec.dtype)
            if leaf in owner._parameters:
                owner._parameters[leaf] = nn.Parameter(tensor, requires_grad=False)
            else:
                owner._buffers[leaf] = tensor
        # RoPE frequencies are computed, not loaded: a fresh module keeps them in fp32 like the trainer's.
        self._replace(model, prefix + "model.rotary_emb", type(lm.model.rotary_emb)(lm.config))
        return model

    @staticmethod
    def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
        parent, _, child = name.rpartition(".")
        model.get_submodule(parent).register_module(child, module)

    # weights ------------------------------------------------------------------------------------

    @property
    def weight_version(self) -> int:
        """Version of the weights in use; -1 before the first `load_weights`."""
        return self._version

    def wire_state(self) -> dict[str, Tensor]:
        """Copies of the tensors the engine holds, by wire name (the dtypes it computes from)."""
        return {name: t.detach().clone() for name, t in self.model.state_dict().items()}

    def _check_wire(self, wire: dict[str, Tensor]) -> list[str]:
        problems = [f"{name}: missing (the plan sends it)" for name in self.expected if name not in wire]
        problems += [
            f"{name}: not in the {self.precision_cfg.name.value} plan of this model"
            for name in wire
            if name not in self.expected
        ]
        for name, spec in self.expected.items():
            tensor = wire.get(name)
            if tensor is None:
                continue
            if not isinstance(tensor, Tensor):
                problems.append(f"{name}: expected a torch.Tensor, got {type(tensor).__name__}")
            elif (tuple(tensor.shape), tensor.dtype) != (spec.shape, spec.dtype):
                problems.append(
                    f"{name}: expected shape {spec.shape} {spec.dtype}, got {tuple(tensor.shape)} {tensor.dtype}"
                )
        return problems

    def _stack_groups_of_plan(self) -> list[list[ParamPlan]]:
        """Quantized plan entries that dequantize as one stack: same role, same wire shapes and
        dtypes (one projection's routed experts, attention projections of equal shape)."""
        groups: dict[tuple, list[ParamPlan]] = {}
        for entry in self.plan:
            if entry.quantized:
                stem = entry.name.removesuffix("weight")
                key = (entry.role, tuple((w.name.removeprefix(stem), w.shape, w.dtype) for w in entry.wire))
                groups.setdefault(key, []).append(entry)
        return list(groups.values())

    def _values_pass(self, wire: dict[str, Tensor]) -> bool:
        """True only if every unit passes `_check_values_each`: each stack group dequantized in one
        call (the formats check and decode each [N, K] matrix of a stack on its own) and tested
        finite, the unquantized floats tested per dtype in one reduction. The results stay on the
        device and are read once (the quantizers' own checks inside one deferred scope), so a GPU
        pays one host sync per weight update, not several per group. False may be a false alarm
        (e.g. int4 weight_shape rows that differ), which the per-unit checks then settle."""
        flags: list[Tensor] = []
        try:
            with dispatch.deferred_finite_checks():
                for group in self._stack_groups:
                    unit = self._stacked_unit(group, wire)
                    if unit is None:
                        return False
                    value = self.strategy.deserialize(group[0].name, unit, role=group[0].role)
                    flags.append(torch.isfinite(value).all())
                by_dtype: dict[torch.dtype, list[Tensor]] = {}
                for entry in self.plan:
                    if not entry.quantized and wire[entry.name].is_floating_point():
                        by_dtype.setdefault(wire[entry.name].dtype, []).append(wire[entry.name].reshape(-1))
                flags += [torch.isfinite(torch.cat(flat)).all() for flat in by_dtype.values()]
        except (QuantizationError, RuntimeError):  # let the per-unit checks name the problem
            return False
        return not flags or bool(torch.stack([f.to(flags[0].device) for f in flags]).all())

    @staticmethod
    def _stacked_unit(group: list[ParamPlan], wire: dict[str, Tensor]) -> dict[str, Tensor] | None:
        """The wire tensors of a stack group as one unit (members stacked), None if the members'
        shared tensors (int4 weight_shape) differ."""
        first = group[0].name.removesuffix("weight")
        unit: dict[str, Tensor] = {}
        for w in group[0].wire:
            suffix = w.name.removeprefix(first)
            members = [wire[e.name.removesuffix("weight") + suffix] for e in group]
            if suffix in _SHARED_SUFFIXES:  # describes the matrix, passed once when all agree
                if not all(torch.equal(m, members[0]) for m in members[1:]):
                    return None
                unit[w.name] = members[0]
            else:
                unit[w.name] = members[0] if len(members) == 1 else torch.stack(members)
        return unit

    def _check_values_each(self, wire: dict[str, Tensor]) -> None:
        """Dequantize every unit once (it refuses NaN codes and bad scales) and check bf16 tensors are finite."""
        for entry in self.plan:
            unit = {w.name: wire[w.name] for w in entry.wire}
            try:
                value = (
                    self.strategy.deserialize(entry.name, unit, role=entry.role)
                    if entry.quantized
                    else unit[entry.name]
                )
            except QuantizationError as exc:
                raise WeightLoadError(f"weight version rejected: {exc}") from exc
            if value.is_floating_point() and not bool(torch.isfinite(value).all()):
                raise WeightLoadError(f"{entry.name}: non-finite values; weight version rejected")

    def _check_values(self, wire: dict[str, Tensor]) -> None:
        """The per-unit checks, run only when the batched pass does not clear every unit: the same
        acceptance, the same error naming the first bad unit, one quantizer call per stack."""
        if not self._values_pass(wire):
            self._check_values_each(wire)

    def _on_device(self, wire: dict[str, Tensor]) -> dict[str, Tensor]:
        """`wire` on the engine's device: a received `WireState` one copy per frame (host frames
        from a trainer that shares this GPU, over gloo), any other mapping tensor by tensor (a
        checkpoint read on the host). Its values are then checked and copied in where they are
        used, not dequantized on the host and copied in one tensor at a time."""
        if isinstance(wire, WireState):
            return wire.to(self.device)
        return {name: tensor.to(self.device) for name, tensor in wire.items()}

    def load_weights(self, wire: dict[str, Tensor], version: int) -> None:
        """Replace all weights with `wire` (every wire tensor of the plan) and set the version.

        Everything is validated first — names, shapes, dtypes, finite values, a version newer than
        the current one — and on any problem a `WeightLoadError` names the tensor and nothing changes.
        """
        if not isinstance(version, int) or version <= self._version:
            raise WeightLoadError(
                f"weight version {version!r} refused: the engine holds version {self._version}, "
                "updates must carry a strictly increasing version"
            )
        problems = self._check_wire(wire)
        if problems:
            shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
            raise WeightLoadError(
                f"weight version {version} rejected, engine keeps version {self._version}: {shown}"
            )
        wire = self._on_device(wire)
        self._check_values(wire)
        # A received `WireState` is copied as integer words, one multi-tensor copy per word size
        # (destination views kept per layout); any other dict as one multi-tensor copy per dtype.
        self._copier.copy(wire)
        self._version = version

    def load_checkpoint(self, path: str | Path, *, version: int = 0) -> None:
        """Boot from a checkpoint already in the precision's wire format, as `version`: the rollout
        checkpoint of the seed's two-checkpoint layout (int4_qat: the W4A16 release, e.g. Kimi-K2.6's,
        while the trainer starts from its BF16 cast; bf16: the BF16 checkpoint itself).

        The checkpoint is read through `ShardedCheckpoint` (index, shards and their checksums
        verified), its config.json must describe this model, and its tensors must be exactly the
        plan's wire tensors: they go through `load_weights`, so a missing scale, a BF16 tensor where
        the plan sends INT4 words or a non-finite value is refused naming it, and nothing changes."""
        from skyq.checkpoint.errors import CheckpointError
        from skyq.checkpoint.hf_config import HFConfigError, architecture_mismatches
        from skyq.checkpoint.reader import ShardedCheckpoint

        try:
            checkpoint = ShardedCheckpoint(path)
            checkpoint.verify_checksums()
            wrong = architecture_mismatches(checkpoint.config(), self.model_cfg)
        except (CheckpointError, HFConfigError) as exc:
            raise WeightLoadError(f"{path}: cannot boot the engine from it: {exc}") from exc
        if wrong:
            raise WeightLoadError(
                f"{path} is another model than model={self.model_cfg.name} ({'; '.join(wrong)}); fix "
                "checkpoint.rollout_checkpoint or model.*"
            )
        wire: dict[str, Tensor] = {}
        for shard in checkpoint.shard_names:
            wire.update(checkpoint.read_shard(shard))
        try:
            self.load_weights(wire, version)
        except WeightLoadError as exc:
            raise WeightLoadError(
                f"{path} does not hold the {self.precision_cfg.name.value} wire tensors of this model: {exc}"
            ) from exc

    # scoring ------------------------------------------------------------------------------------

    @torch.inference_mode()
    def score(
        self,
        input_ids: Tensor,
        attention_mask: Tensor,
        *,
        temperature: float = 1.0,
        images: list[PromptImages | None] | None = None,
    ) -> Tensor:
        """[B, T] fp32 log-prob of each token given the ones before it (0 at position 0) and the rows'
        `images` (a multimodal batch), computed like sampling computes them (bf16, wire-format weights,
        quantized activations) but teacher-forced in one forward: the engine's side of a mismatch
        measured on given sequences."""
        if self._version == NO_WEIGHTS:
            raise WeightLoadError("score called before load_weights: the engine holds no weights yet")
        ids, mask = input_ids.to(self.device), attention_mask.to(self.device)
        positions = (mask.long().cumsum(dim=-1) - 1).clamp(min=0)
        with dispatch.deferred_finite_checks():
            extra = {} if images is None else {"images": images}
            logits = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, **extra).logits
        logp = torch.log_softmax(logits[:, :-1].float() / temperature, dim=-1).gather(-1, ids[:, 1:, None])
        return torch.nn.functional.pad(logp.squeeze(-1), (1, 0)).cpu()

    # sampling -----------------------------------------------------------------------------------

    @torch.inference_mode()
    def generate(
        self,
        prompts: list[list[int]],
        *,
        n: int,
        max_new_tokens: int,
        temperature: float,
        top_p: float,
        seed: int,
    ) -> list[Sample]:
        """`n` samples per prompt, grouped: result[i * n + j] is sample j of prompt i.

        Prompts of equal length are decoded together (no padding, so positions and masks are
        trivially those the trainer recomputes); a row that emitted eos keeps decoding in the batch
        but its tokens are dropped. A multimodal prompt (an `ImagePrompt`) is prefilled with its images'
        embeddings in place of its placeholder tokens (the vision tower and projector run here, on the
        bf16 weights of the last sync); its samples carry its images.
        """
        if self._version == NO_WEIGHTS:
            raise WeightLoadError("generate called before load_weights: the engine holds no weights yet")
        check_sampling_args(temperature, top_p)
        if n <= 0 or max_new_tokens <= 0:
            raise ValueError(
                f"generate needs n > 0 and max_new_tokens > 0, got n={n}, max_new_tokens={max_new_tokens}"
            )
        generator = torch.Generator().manual_seed(sampling_seed(self.seed, seed))
        results: list[Sample | None] = [None] * (len(prompts) * n)
        by_length: dict[int, list[int]] = {}
        for i, prompt in enumerate(prompts):
            if not prompt:
                raise ValueError(f"prompt {i} is empty")
            by_length.setdefault(len(prompt), []).append(i)
        # The quantizers' finite checks (activation codes, dequantized weights) are read once at the
        # end instead of once per linear per token: a non-finite value still fails the whole call.
        with dispatch.deferred_finite_checks():
            for length in sorted(by_length):
                group = by_length[length]
                rows = [prompts[i] for i in group for _ in range(n)]
                images = [images_of(row) for row in rows]
                if all(i is None for i in images):
                    images = None
                elif not hasattr(self.model, "vision_tower"):
                    raise ValueError(
                        f"a prompt with images given to model={self.model_cfg.name}, which has no vision tower"
                    )
                samples = self._sample_rows(rows, max_new_tokens, temperature, top_p, generator, images)
                for k, sample in enumerate(samples):
                    results[group[k // n] * n + k % n] = sample
        assert all(s is not None for s in results)
        return results  # type: ignore[return-value]

    def _decoder(self, rows: int, positions: int) -> DynamicDecoder | StaticDecoder:
        """The decoder for `rows` prompts of `positions` total tokens: a fresh growing cache, or a
        kept fixed-capacity one (padded rows, rounded capacity; the least recently used dropped)."""
        cache_kwarg = _cache_kwarg(causal_lm_class(self.model_cfg))
        if self.decode_mode == "dynamic":
            return DynamicDecoder(self.model, cache_kwarg, rows)
        key = (padded_batch(rows), cache_capacity(positions))
        decoder = self._decoders.pop(key, None)
        if decoder is None:
            budget, need = self._cache_budget(), self._kv_bytes(*key)
            while self._decoders and (
                len(self._decoders) >= DECODERS_KEPT
                or sum(self._kv_bytes(*k) for k in self._decoders) + need > budget
            ):
                self._decoders.popitem(last=False)
            graph = self.decode_mode == "graph" and self._step_capturable(key[0])
            decoder = StaticDecoder(self.model, cache_kwarg, *key, graph=graph)
        self._decoders[key] = decoder
        decoder.begin()
        return decoder

    def _kv_bytes(self, batch: int, capacity: int) -> int:
        """Bytes of a static KV cache (bf16, every layer) for `batch` rows: keys and values of each
        key/value head, or MLA's compressed latent and shared rotary key."""
        m, bf16_bytes = self.model_cfg, 2
        if ModelFamily(m.family) is ModelFamily.deepseek_v3:
            per_position = m.kv_lora_rank + m.qk_rope_head_dim
        else:
            per_position = 2 * m.num_key_value_heads * m.head_dim
        return m.num_layers * batch * capacity * per_position * bf16_bytes

    def _cache_budget(self) -> float:
        """Bytes the kept decoders' caches may hold (`DECODER_CACHE_FRACTION` of a CUDA device)."""
        if self.device.type != "cuda":
            return float("inf")
        return torch.cuda.get_device_properties(self.device).total_memory * DECODER_CACHE_FRACTION

    def _step_capturable(self, rows: int) -> bool:
        """Whether a one-token step of `rows` rows launches without a host sync: bf16, FP8 blockwise
        (the FP8 decode, dequantize and activation kernels defer their checks), INT4 or MXFP8 weights
        (every INT4 / MXFP8 linear taking its weight-only decode kernel, `decodes_in_kernel`), every
        experts block taking its grouped path (else, e.g. where a kernel does not take an MXFP8
        weight, the per-expert loop reads the routing on the host and the step runs eagerly over
        the same static cache)."""
        precision = Precision(self.precision_cfg.name)
        if precision not in (Precision.bf16, Precision.fp8_blockwise, Precision.int4_qat, Precision.mxfp8):
            return False
        probe = torch.empty((rows, self.model.config.hidden_size), dtype=torch.bfloat16, device=self.device)
        if precision is not Precision.bf16 and not dispatch.uses_kernel(probe):
            return False
        if precision in (Precision.int4_qat, Precision.mxfp8) and not self._linears_decode_in_kernels(
            rows, precision
        ):
            return False
        top_k = self.model.config.num_experts_per_tok
        with decode_step():  # what the step's forward will see
            return all(m.capturable(probe, top_k) for m in self.model.modules() if isinstance(m, WireExperts))

    def _linears_decode_in_kernels(self, rows: int, precision: Precision) -> bool:
        """Every INT4 / MXFP8 `WireLinear` outside the stacked experts takes its weight-only decode
        kernel for `rows` rows (an asymmetric INT4 one, or one a kernel does not take, dequantizes
        with host syncs)."""
        for linear in self.model.modules():
            if isinstance(linear, WireLinear) and linear.strategy.precision is precision:
                if precision is Precision.int4_qat:
                    k = linear._buffers["weight_packed"].shape[-1] * int4.CODES_PER_WORD
                else:
                    k = linear._buffers["weight"].shape[-1]
                probe = torch.empty((rows, k), dtype=torch.bfloat16, device=self.device)
                if not decodes_in_kernel(linear, probe):
                    return False
        return True

    def _sample_rows(
        self,
        rows: list[list[int]],
        max_new_tokens: int,
        temperature: float,
        top_p: float,
        generator: torch.Generator,
        images: list[PromptImages | None] | None = None,
    ) -> list[Sample]:
        """Decode equal-length prompts together with a KV cache; one Sample per row. Rows a
        fixed-capacity decoder pads the batch with repeat the last row and are never sampled.
        `images` (one entry per row) go into the prefill.

        Everything per step stays on the engine's device: the sampler (uniforms drawn up front from
        `generator`), the eos bookkeeping and each step's status (all rows finished, non-finite
        logits, the replay's quantizer flags). On CUDA the status is copied to the host without
        waiting and read one step later, so the GPU always has the next step queued while the host
        reads the last (a call may decode one step past the last eos; its tokens are dropped)."""
        input_ids = torch.tensor(rows, dtype=torch.long, device=self.device)
        n_rows, prompt_len = input_ids.shape
        decoder = self._decoder(n_rows, prompt_len + max_new_tokens)
        uniforms = draw_uniforms(generator, max_new_tokens, n_rows).to(self.device)
        tokens_out = torch.zeros((n_rows, max_new_tokens), dtype=torch.long, device=self.device)
        logprobs_out = torch.zeros((n_rows, max_new_tokens), dtype=torch.float32, device=self.device)
        lengths = torch.full((n_rows,), max_new_tokens, dtype=torch.long, device=self.device)
        finished = torch.zeros(n_rows, dtype=torch.bool, device=self.device)
        status = _StepStatus(self.device)
        step_input = _pad_rows(input_ids, decoder.batch)
        steps = 0
        for step in range(max_new_tokens):
            prefill_images = None
            if step == 0 and images is not None:
                prefill_images = images + [images[-1]] * (decoder.batch - n_rows)
            logits = decoder.forward(step_input, verify=False, images=prefill_images)[:n_rows]
            tokens, logprobs = sample_tokens(
                logits, temperature=temperature, top_p=top_p, uniforms=uniforms[step]
            )
            tokens_out[:, step], logprobs_out[:, step] = tokens, logprobs
            stopped_now = ~finished & (tokens == self.eos_token_id)
            lengths.masked_fill_(stopped_now, step + 1)
            finished |= stopped_now
            steps = step + 1
            if step == 0:  # the prefill filled the cache (the rest is checked once at the end)
                self._check_cache(decoder, prompt_len, step)
            status.post(step, finished.all(), torch.isfinite(logits).all(), decoder.flags_seen())
            if any(self._check_status(s, decoder, n_rows, prompt_len) for s in status.ready(lag=1)):
                break
            step_input = _pad_rows(tokens[:, None], decoder.batch)
        for s in status.ready(lag=0):
            self._check_status(s, decoder, n_rows, prompt_len)
        self._check_cache(decoder, prompt_len, steps - 1)
        tokens_cpu, logprobs_cpu, lengths_cpu = tokens_out.cpu(), logprobs_out.cpu(), lengths.cpu()
        finished_cpu = finished.cpu()
        return [
            Sample(
                prompt_ids=list(rows[r]),
                response_ids=tokens_cpu[r, : lengths_cpu[r]].tolist(),
                logprobs=logprobs_cpu[r, : lengths_cpu[r]].tolist(),
                finish_reason=FinishReason.stop if finished_cpu[r] else FinishReason.length,
                images=None if images is None else images[r],
            )
            for r in range(len(rows))
        ]

    @staticmethod
    def _check_cache(decoder: DynamicDecoder | StaticDecoder, prompt_len: int, step: int) -> None:
        """The cache holds the prompt and one position per later step (one host sync): a model that
        silently ignored the cache would decode every later token without context."""
        if decoder.seq_length() != prompt_len + step:
            raise RuntimeError(
                f"the KV cache holds {decoder.seq_length()} positions after decode step {step}, expected "
                f"{prompt_len + step}: this transformers version does not take the cache as "
                f"`{decoder.cache_kwarg}`; the engine would sample without context"
            )

    def _check_status(
        self,
        status: tuple[int, bool, bool, int],
        decoder: DynamicDecoder | StaticDecoder,
        rows: int,
        prompt_len: int,
    ) -> bool:
        """Act on one step's status: raise on a replay's quantizer flag (the flagged tensor's own
        error when the step in hand still shows it) or on non-finite logits; True when every row
        has finished."""
        step, done, logits_finite, flags = status
        if flags:
            decoder.verify()
            raise QuantizationError(
                f"a quantizer's finite check failed in replayed decode step {step} ({rows} rows, prompt length "
                f"{prompt_len}) and the values were gone before the tensor could be named; rerun with "
                "rollout.cuda_graphs=false to name it"
            )
        if not logits_finite:
            # eager steps' quantizer checks first (the generate scope's): a flagged tensor is named
            scope = _common.active_deferred()
            if scope is not None:
                scope.flush()
            raise RuntimeError(
                f"the model produced non-finite logits at decode step {step} ({rows} rows, prompt length "
                f"{prompt_len}, weight version {self._version}): NaN or inf in the weights' products or "
                "activations; nothing was sampled from them"
            )
        return done


class TextPrefixed(nn.Module):
    """A causal LM held under `prefix` (`language_model.`: the text model of Kimi-K2.6's checkpoint),
    so its state dict carries the checkpoint's names; calls go to the LM unchanged. With
    `model.vision_num_layers` > 0 it also holds Kimi-K2.6's `vision_tower` and `mm_projector`
    (`skyq.trainer.native.vision`, checkpoint names), and a call with `images` (a prefill) gives the LM
    input embeddings with each row's images in place of its placeholder tokens."""

    def __init__(self, prefix: str, lm: nn.Module, *, model_cfg: ModelConfig | None = None) -> None:
        super().__init__()
        if model_cfg is not None and model_cfg.vision_num_layers:
            from skyq.trainer.native.vision import Projector, VisionTower

            self.vision_tower = VisionTower(model_cfg)
            self.mm_projector = Projector(model_cfg)
        *outer, last = prefix.removesuffix(".").split(".")
        holder: nn.Module = self
        for part in outer:
            holder.register_module(part, nn.Module())
            holder = holder.get_submodule(part)
        holder.register_module(last, lm)
        self._lm_path = prefix.removesuffix(".")

    @property
    def lm(self) -> nn.Module:
        return self.get_submodule(self._lm_path)

    @property
    def config(self):
        """The LM's transformers config (what decoders and caches read)."""
        return self.lm.config

    def forward(self, *, input_ids: Tensor, images: list[PromptImages | None] | None = None, **kwargs):
        if images is None:
            return self.lm(input_ids=input_ids, **kwargs)
        from skyq.trainer.native.vision import embed_with_images

        embeds = embed_with_images(
            self.lm.model.embed_tokens, self.vision_tower, self.mm_projector, input_ids, images
        )
        return self.lm(inputs_embeds=embeds, **kwargs)


class _StepStatus:
    """Each decode step's (all rows finished, logits finite, replay flags seen) on the host. On CUDA
    copied into pinned buffers without waiting and handed out `lag` steps later (the copy is then
    long done, or nearly); elsewhere at once."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.pending: list[tuple[int, Tensor, torch.cuda.Event | None]] = []
        self._zero = torch.zeros((), dtype=torch.int64, device=device)

    def post(self, step: int, done: Tensor, finite: Tensor, flags: Tensor | None) -> None:
        values = torch.stack([done.long(), finite.long(), self._zero if flags is None else flags])
        if not self.cuda:
            self.pending.append((step, values, None))
            return
        host = torch.empty(3, dtype=torch.int64, pin_memory=True)
        host.copy_(values, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self.pending.append((step, host, event))

    def ready(self, lag: int) -> list[tuple[int, bool, bool, int]]:
        """The statuses of all but the last `lag` posted steps (all of them off CUDA), oldest first."""
        keep = lag if self.cuda else 0
        out, self.pending = self.pending[: len(self.pending) - keep], self.pending[len(self.pending) - keep :]
        result = []
        for step, values, event in out:
            if event is not None:
                event.synchronize()
            done, finite, flags = values.tolist()
            result.append((step, bool(done), bool(finite), int(flags)))
        return result


def _pad_rows(ids: Tensor, batch: int) -> Tensor:
    """`ids` [R, T] with its last row repeated to `batch` rows."""
    return ids if ids.shape[0] == batch else torch.cat([ids, ids[-1:].expand(batch - ids.shape[0], -1)])
