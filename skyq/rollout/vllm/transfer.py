"""skyq's weight-transfer backend for vLLM workers: skyq's accounted sync, loaded through vLLM's
layerwise reload.

vLLM's RL weight-transfer API (`init_weight_transfer_engine` / `start_weight_update` /
`update_weights` / `finish_weight_update`) drives a `WeightTransferEngine` inside each worker; this
one (registered as backend "skyq" by `worker_ext`) receives skyq's buckets over a two-rank gloo/NCCL
group (`skyq.sync.torch_dist`) with skyq's `WeightReceiver`: the manifest is accounted against the
plan (every expected checkpoint name exactly once, nothing unknown, a weight and its scales
together), every bucket's checksum is verified, and only then does the commit load the tensors
(views of the verified bytes) into vLLM, one decoder layer at a time. After loading, every vLLM
layer must have been filled completely (`uncovered_layers`); only then does the version advance.
A refusal before loading leaves vLLM's weights untouched; a failure while loading (which the
boot-time placement check `placement_problem` is there to rule out) leaves them mixed, so the
engine is marked unusable until a later sync fully succeeds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.model_executor.model_loader.reload.layerwise import (
    finalize_layerwise_reload,
    get_layerwise_info,
    initialize_layerwise_reload,
)

from skyq.rollout.vllm.compat import (
    checkpoint_copies,
    is_deferred_attention_layer,
    layer_groups,
    repack_cpu_moe,
    skip_load_tensors,
    tensor_load_numel,
)
from skyq.rollout.vllm.transfer_names import BACKEND  # noqa: F401  (re-exported)
from skyq.sync.errors import SyncError
from skyq.sync.plan_wire import WireDigest, wire_digest
from skyq.sync.receiver import ExpectedUnit, ReceiveStats, WeightReceiver
from skyq.sync.torch_dist import RECEIVER_RANK, TorchDistChannel, connect_store
from skyq.sync.wire_dtypes import dtype_from_name

ExpectedJson = list[tuple[str, dict[str, tuple[list[int], str]]]]
"""Expected units as plain data (RPC-safe): [(source, {wire name: (shape, dtype name)})]."""


def expected_from_json(units: ExpectedJson) -> list[ExpectedUnit]:
    return [
        ExpectedUnit(
            source=source, tensors={n: (tuple(s), dtype_from_name(d)) for n, (s, d) in tensors.items()}
        )
        for source, tensors in units
    ]


@dataclass
class SkyqInitInfo(WeightTransferInitInfo):
    """Where the trainer's weight-sync store listens, and what the engine expects to receive."""

    port: int
    timeout_s: float
    expected: ExpectedJson = field(default_factory=list)
    verify_checksum: bool = True
    host: str = "127.0.0.1"


@dataclass
class SkyqUpdateInfo(WeightTransferUpdateInfo):
    """One sync: everything else (names, shapes, checksums) arrives in skyq's manifest."""


def loadable_numel(layer: torch.nn.Module) -> int:
    """Elements a checkpoint fills in `layer` (checkpoint format), as vLLM's reload counts them: its
    loadable tensors, each times the checkpoint tensors that fill it (`compat.checkpoint_copies`: 0
    for W4A16 act-order tensors no checkpoint without act order carries), less non-persistent buffers
    (computed, e.g. RoPE's cos/sin cache) and a vocabulary's padding rows."""
    params, buffers = get_layerwise_info(layer).restore_metadata
    skip = skip_load_tensors() | set(layer._non_persistent_buffers_set)
    total = sum(
        tensor_load_numel(t) * checkpoint_copies(layer, n)
        for n, t in (params | buffers).items()
        if n not in skip
    )
    shard = getattr(layer, "shard_indices", None)  # VocabParallelEmbedding / ParallelLMHead
    if shard is not None and total:
        rows = (shard.org_vocab_end_index - shard.org_vocab_start_index) + (
            shard.added_vocab_end_index - shard.added_vocab_start_index
        )
        total = total * rows // layer.num_embeddings_per_partition
    return total


def checkpoint_numel(model: torch.nn.Module) -> int:
    """Elements a complete sync fills in `model`; attention layers (whose scales bf16 / block-FP8
    checkpoints do not carry) excluded."""
    return sum(loadable_numel(layer) for layer in model.modules() if not is_deferred_attention_layer(layer))


def placement_problem(model: torch.nn.Module, expected: list[ExpectedUnit]) -> str | None:
    """Why the expected wire tensors cannot fill vLLM's model exactly once (None: they can): their
    element count must equal what the model loads. A name vLLM cannot place, or a vLLM parameter no
    name fills, breaks the balance, and is caught here, at init, before any weight changes."""
    wire = sum(_numel(shape) for unit in expected for shape, _ in unit.tensors.values())
    model_numel = checkpoint_numel(model)
    if wire != model_numel:
        return (
            f"the plan's wire tensors hold {wire} elements but vLLM's model loads {model_numel}: "
            "some names would not be placed or some vLLM parameters not filled. The engine must be "
            "booted from the same model and precision config as the trainer"
        )
    return None


def uncovered_layers(model: torch.nn.Module) -> list[str]:
    """vLLM layers a reload in progress has not filled completely (processed layers are reset; a
    layer with vocabulary padding waits for finalize with its real rows filled; attention layers wait
    for finalize by design)."""
    out = []
    for name, layer in model.named_modules():
        info = get_layerwise_info(layer)
        if is_deferred_attention_layer(layer) or not info.can_load():
            continue
        if info.load_numel_total and info.load_numel < loadable_numel(layer):
            out.append(f"{name or '<root>'} ({info.load_numel}/{info.load_numel_total} elements)")
    return out


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


class SkyqWeightTransferEngine(WeightTransferEngine[SkyqInitInfo, SkyqUpdateInfo]):
    """Worker-side end of skyq's weight sync (see the module docstring)."""

    init_info_cls = SkyqInitInfo
    update_info_cls = SkyqUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.version = 0
        """The committed weight version (0: the weights the engine booted with)."""
        self.unusable: str | None = None
        """Why the weights are mixed (a load failed part-way); None when they are one version."""
        self.last: ReceiveStats | None = None
        self._receiver: WeightReceiver | None = None
        self._channel: TorchDistChannel | None = None
        self._committed_this_update = False
        self.first_digest: WireDigest | None = None
        """Digest of the wire state of this engine's first committed sync (`plan_wire.wire_digest`):
        the run compares it with the trainer's serialized weights, bit for bit, once per session."""

    def init_transfer_engine(self, init_info: SkyqInitInfo) -> None:
        expected = expected_from_json(init_info.expected)
        problem = placement_problem(self.model, expected)
        if problem is not None:
            raise SyncError(f"skyq weight transfer refused at init: {problem}")
        store = connect_store(init_info.port, init_info.timeout_s, host=init_info.host)
        self._channel = TorchDistChannel(
            store, rank=RECEIVER_RANK, timeout_s=init_info.timeout_s, device=torch.device("cpu")
        )
        self._receiver = WeightReceiver(self._channel, expected, verify_checksum=init_info.verify_checksum)

    def start_weight_update(self) -> None:
        """Nothing changes yet: vLLM's reload starts only once the sync is accounted for."""
        if self._receiver is None:
            raise SyncError("start_weight_update before init_weight_transfer_engine")
        self._committed_this_update = False

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class synchronizes the accelerator afterwards; skyq's load is synchronous.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: SkyqUpdateInfo) -> None:
        assert self._receiver is not None
        self.last = self._receiver.receive(current_version=self.version, commit=self._load)
        self._committed_this_update = True

    def finish_weight_update(self) -> None:
        if not self._committed_this_update:
            raise SyncError("finish_weight_update: no sync was committed since start_weight_update")

    def _load(self, wire: dict[str, torch.Tensor], version: int) -> None:
        """Load a verified wire state into vLLM, one decoder layer at a time, and account for it."""
        groups = layer_groups(list(wire))
        self.unusable = f"the load of weight version {version} failed part-way"
        initialize_layerwise_reload(self.model)
        try:
            for group in groups:
                self.model.load_weights([(name, wire[name]) for name in group])
            uncovered = uncovered_layers(self.model)
        finally:
            finalize_layerwise_reload(self.model, self.model_config)
        if uncovered:
            self.unusable = f"weight version {version} left vLLM layers unfilled: {uncovered[:4]}"
            raise SyncError(
                f"weight version {version} did not fill {len(uncovered)} vLLM layers completely "
                f"(first: {uncovered[:4]}); the engine's weights are mixed until a sync succeeds"
            )
        repack_cpu_moe(self.model)
        if self.first_digest is None:
            self.first_digest = wire_digest(wire)
        self.version = version
        self.unusable = None

    @staticmethod
    def trainer_send_weights(iterator, trainer_args) -> None:
        """vLLM 0.26's base class declares the trainer's send here (abstract, so the class must define
        it to be built); skyq's trainer sends with `skyq.sync.sender.WeightSender`, never through the
        worker-side class, so a call here is a programming error, refused."""
        raise NotImplementedError("skyq's trainer sends with skyq.sync.sender.WeightSender")

    def shutdown(self) -> None:
        if self._channel is not None:
            self._channel.close()
        self._channel = self._receiver = None
