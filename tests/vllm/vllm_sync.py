"""The sending side of skyq's weight sync to a `VllmEngine`, for tests/vllm: skyq's WeightSender over
a gloo group, in a thread of the test process (the engine's worker runs in the test process too)."""

from __future__ import annotations

import threading

import torch

from skyq.config.enums import Precision
from skyq.config.schema import ModelConfig, PrecisionConfig
from skyq.quant.plan import build_plan
from skyq.quant.strategies import get_strategy
from skyq.rollout.vllm.engine import VllmEngine
from skyq.sync.errors import SyncRefused
from skyq.sync.plan_wire import plan_serializer
from skyq.sync.sender import WeightSender
from skyq.sync.torch_dist import SENDER_RANK, TorchDistChannel, open_store

TIMEOUT_S = 60.0


class SyncTrainer:
    """One sender joined to one engine's sync group, serializing with the precision's plan."""

    def __init__(
        self, engine: VllmEngine, *, model_cfg: ModelConfig, precision_cfg: PrecisionConfig, serialize=None
    ) -> None:
        store = open_store(TIMEOUT_S)
        joined: dict = {}
        thread = threading.Thread(
            target=lambda: joined.update(
                channel=TorchDistChannel(
                    store, rank=SENDER_RANK, timeout_s=TIMEOUT_S, device=torch.device("cpu")
                )
            )
        )
        thread.start()
        engine.join_sync_group(store.port, TIMEOUT_S)
        thread.join()
        self.store, self.channel, self.engine = store, joined["channel"], engine
        plan = build_plan(model_cfg, precision_cfg)
        serialize = serialize or plan_serializer(get_strategy(precision_cfg), plan)
        self.sender = WeightSender(self.channel, serialize=serialize, bucket_bytes=1 << 20)

    def sync(self, weights: list[tuple[str, torch.Tensor]], version: int) -> dict[str, float]:
        """Send and receive one sync; the sender's error (if any) is raised after the engine's."""
        result: dict = {}

        def send() -> None:
            try:
                result["stats"] = self.sender.sync(weights, version)
            except BaseException as exc:  # re-raised below, after the engine's side
                result["error"] = exc

        thread = threading.Thread(target=send)
        thread.start()
        try:
            return self.engine.receive_weights()
        finally:
            thread.join()
            if "error" in result and not isinstance(result["error"], SyncRefused):
                raise result["error"]


def random_weights(model: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """A random bf16 checkpoint of `model` by HF name (norms around 1, the rest around 0)."""
    gen = torch.Generator().manual_seed(seed)
    plan = build_plan(model, PrecisionConfig(name=Precision.bf16))
    return {
        p.name: (torch.randn(p.shape, generator=gen) * 0.1 + (p.role.value == "norm")).to(p.dtype)
        for p in plan
    }


def perturbed(weights: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """`weights` plus fresh noise (5% of each tensor's spread)."""
    gen = torch.Generator().manual_seed(seed)
    return {
        n: (t.float() + 0.05 * t.float().std() * torch.randn(t.shape, generator=gen)).to(t.dtype)
        for n, t in weights.items()
    }
