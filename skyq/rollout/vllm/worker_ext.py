"""The worker extension vLLM mixes into its worker (`worker_extension_cls`): skyq's accounting RPCs.

Importing this module, which vLLM does in every worker process before the model loads, registers
skyq's weight-transfer backend and dummy-weight loader (`dummy_loader`) there and asks Linux for the
AMX tile state (`compat`). Methods are
`skyq_`-prefixed so they can never shadow a vLLM worker method.
"""

from __future__ import annotations

import hashlib
import itertools
from typing import Any

import torch
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

from skyq.rollout.vllm import dummy_loader  # noqa: F401  (registers compat.DUMMY_LOAD_FORMAT)
from skyq.rollout.vllm.compat import request_amx_tiles
from skyq.rollout.vllm.transfer import BACKEND, SkyqWeightTransferEngine, checkpoint_numel

try:
    WeightTransferEngineFactory.register_engine(
        BACKEND, "skyq.rollout.vllm.transfer", "SkyqWeightTransferEngine"
    )
except ValueError:  # already registered in this process (a second engine)
    pass
request_amx_tiles()


class SkyqWorkerExtension:
    """RPCs the engine driver calls through `collective_rpc`."""

    def _skyq_transfer(self) -> SkyqWeightTransferEngine:
        engine = getattr(self, "weight_transfer_engine", None)
        if not isinstance(engine, SkyqWeightTransferEngine):
            raise RuntimeError(
                f"the vLLM worker's weight transfer backend is {type(engine).__name__}, not skyq's; "
                f"boot the engine with weight_transfer_config={{'backend': '{BACKEND}'}}"
            )
        return engine

    def skyq_weight_version(self) -> int:
        """The committed weight version."""
        return self._skyq_transfer().version

    def skyq_set_booted_version(self, version: int) -> None:
        """Record the version of the weights the engine booted with (`engine.NO_WEIGHTS` for dummy
        weights: it refuses to generate until a sync)."""
        self._skyq_transfer().version = version

    def skyq_unusable(self) -> str | None:
        """Why the worker's weights are mixed (a load failed part-way), or None."""
        return self._skyq_transfer().unusable

    def skyq_last_sync(self) -> dict[str, Any] | None:
        """The last committed sync's receive statistics."""
        last = self._skyq_transfer().last
        if last is None:
            return None
        return {"version": last.version, "num_tensors": last.num_tensors, "bytes": last.bytes,
                "recv_s": last.recv_s, "load_s": last.load_s}  # fmt: skip

    def skyq_checkpoint_numel(self) -> int:
        """Elements a complete sync loads (`transfer.checkpoint_numel`)."""
        return checkpoint_numel(self.model_runner.get_model())

    def skyq_first_wire_digest(self) -> Any:
        """Digest of the wire state of the first sync this engine committed (None before one)."""
        return self._skyq_transfer().first_digest

    def skyq_weight_checksums(self) -> dict[str, str]:
        """sha256 of the bytes of every parameter and buffer of the model, by name (vLLM 0.26
        workers have no `compute_weight_checksums`). Buffers count: vLLM keeps state there that
        a boot sets and a sync never sends (attention layers' `_k_scale` / `_v_scale` / ...)."""
        model = self.model_runner.get_model()
        return {
            name: hashlib.sha256(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()
            for name, t in itertools.chain(model.named_parameters(), model.named_buffers())
        }

    def skyq_shutdown_transfer(self) -> None:
        """Close skyq's sync channel without stopping the engine (vLLM 0.26 has no
        `shutdown_weight_transfer_engine`)."""
        engine = getattr(self, "weight_transfer_engine", None)
        if engine is not None:
            engine.shutdown()
