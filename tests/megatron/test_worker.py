"""trainer=megatron's worker through real Ray actors on the CPU (gloo), tiny Qwen3-MoE.

World size 1 (the registry's pair: the Megatron trainer actor and a real embedded engine actor)
scores and updates like the native trainer on the same HF checkpoint and batch; the two-rank
layouts (TP2 + sequence parallel with the experts split (ETP2) or replicated (ETP1, with and without
EP2) across the TP ranks, EP2, DP2 with the distributed optimizer sharded) equal world size 1 before
and after a step; a save -> load restores the step and the next update bit for bit;
a sync into the engine verifies. Comparisons run at trainer.compute_dtype=fp32, where both trainers
compute the same function to float rounding (bf16 adds the two implementations' different bf16
roundings on top).
"""

from __future__ import annotations

import dataclasses
import json
import time
import warnings

import pytest
import torch

pytest.importorskip("megatron.core")
ray = pytest.importorskip("ray")

from skyq.config.store import compose, to_object  # noqa: E402
from skyq.launch.actor_pair import ActorPair  # noqa: E402
from skyq.launch.checkpointing import sha256_file  # noqa: E402
from skyq.launch.pair import PairSpec, megatron_trainer_kwargs  # noqa: E402
from skyq.launch.placement import placement_for  # noqa: E402
from skyq.launch.ray_local import local_ray  # noqa: E402
from skyq.rl.batch import RolloutBatch  # noqa: E402
from skyq.rl.tokenizer import EOS_ID  # noqa: E402
from skyq.sync.errors import SyncError  # noqa: E402
from skyq.trainer.megatron.worker import MegatronCheckpointError, MegatronTrainerWorker  # noqa: E402
from skyq.trainer.native.tiny_checkpoint import ensure_tiny_checkpoint  # noqa: E402
from skyq.trainer.native.trainer import NativeTrainer, token_logprobs  # noqa: E402

OVERRIDES = [
    "precision=bf16",
    "trainer=megatron",
    "trainer.compute_dtype=fp32",
    "trainer.micro_batch_size=3",  # 8 rows: micro-batches of 3, 3, 2 (DP2: 2 + 2 per rank)
    "model.init_sft_steps=10",
    "algorithm.lr=1e-4",
]
LOGP_TOL = 2e-5
"""Max |megatron - native| token log-prob, same fp32 weights (measured ~7e-6: reduction order)."""
STEP_LOGP_TOL = 5e-4
"""Max |log-prob| difference after one update: Adam's first step moves every weight by about
lr * sign(grad), so a weight whose gradient is ~0 may move either way (at lr 1e-4)."""


@pytest.fixture(scope="module")
def cluster():
    warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine).*")
    with local_ray(num_cpus=2):
        yield


@pytest.fixture(scope="module")
def spec(tmp_path_factory) -> PairSpec:
    cfg = to_object(compose(OVERRIDES))
    path = ensure_tiny_checkpoint(
        cfg.model, cfg.task, cache_dir=tmp_path_factory.getbasetemp() / "skyq_cache"
    )
    return PairSpec(
        model=cfg.model, precision=cfg.precision, algorithm=cfg.algorithm, trainer=cfg.trainer,
        rollout=cfg.rollout, placement=placement_for(cfg.topology), checkpoint_path=str(path),
        seed=0, eos_token_id=EOS_ID, parallel=cfg.topology.parallel, checkpoint=cfg.checkpoint,
    )  # fmt: skip


@pytest.fixture(scope="module")
def batch(spec) -> RolloutBatch:
    """8 right-padded sequences of random tokens (lengths 7..12), responses from position 4."""
    g = torch.Generator().manual_seed(1)
    lengths = torch.tensor([12, 7, 10, 12, 9, 8, 11, 12])
    ids = torch.randint(0, spec.model.vocab_size, (8, 12), generator=g)
    attn = (torch.arange(12)[None] < lengths[:, None]).long()
    response = attn.float()
    response[:, :4] = 0
    return RolloutBatch(
        input_ids=ids, attention_mask=attn, response_mask=response,
        rollout_logprobs=-torch.rand(8, 12, generator=g) * 3 * response,
        advantages=torch.randn(8, generator=g), rewards=torch.rand(8, generator=g),
    )  # fmt: skip


@pytest.fixture(scope="module")
def native(spec, batch) -> dict:
    """The native trainer on the same checkpoint and batch: log-probs, step metrics, log-probs after."""
    torch.manual_seed(0)
    trainer = NativeTrainer(
        model_cfg=spec.model, precision_cfg=spec.precision, optimizer_cfg=spec.trainer.optimizer,
        algorithm_cfg=spec.algorithm, micro_batch_size=spec.trainer.micro_batch_size,
        checkpoint_path=spec.checkpoint_path, seed=0, compute_dtype="fp32",
    )  # fmt: skip
    before = trainer.logprobs(batch.input_ids, batch.attention_mask)
    metrics = trainer.train_step(batch)
    # After the update: on the fp32 masters, as Megatron at compute_dtype=fp32 computes (the native
    # trainer's own forward rounds them to bf16 first, the weights an engine holds).
    with torch.no_grad():
        forward = trainer._forward(dict(trainer.model.named_parameters()))
        after = token_logprobs(forward, batch.input_ids, batch.attention_mask)
    return {"before": before, "metrics": metrics, "after": after}


def _run(worker, batch: RolloutBatch) -> dict:
    """Log-probs, one update's metrics, log-probs after it: through the worker actor's calls."""
    before = ray.get(worker.logprobs.remote(batch.input_ids, batch.attention_mask))
    metrics = ray.get(worker.train_step.remote(batch))
    after = ray.get(worker.logprobs.remote(batch.input_ids, batch.attention_mask))
    return {"before": before, "metrics": metrics, "after": after}


@pytest.fixture(scope="module")
def world_one(cluster, spec, batch):
    """The registry's trainer=megatron rollout=embedded pair (two Ray actors), its first sync
    verified, then `_run` on the batch."""
    pair = ActorPair(spec)
    try:
        first_sync = pair.sync(1)
        pair.verify_engine_matches_trainer()
        first_sync["digest"] = ray.get(pair.trainer.serialized_digest.remote())
        yield pair, first_sync, _run(pair.trainer, batch)
    finally:
        pair.shutdown()


def _max_diff(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    return float(((a - b).abs() * mask).max())


def test_world_size_one_scores_and_updates_like_the_native_trainer(world_one, native, batch):
    _, _, megatron = world_one
    mask = batch.attention_mask.float()
    assert _max_diff(megatron["before"], native["before"], mask) < LOGP_TOL
    mine, theirs = megatron["metrics"], native["metrics"]
    assert set(mine) == set(theirs)
    for key in ("loss", "pg_loss", "ratio_mean", "is_weight_mean", "mismatch_mean_abs", "mismatch_k3"):
        assert mine[key] == pytest.approx(theirs[key], rel=1e-5, abs=1e-6), key
    assert mine["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-5)
    assert (mine["lr"], mine["step"]) == (theirs["lr"], theirs["step"]) == (1e-4, 1.0)
    assert _max_diff(megatron["after"], native["after"], mask) < STEP_LOGP_TOL
    # the update moved the policy by far more than the tolerance
    assert _max_diff(megatron["after"], megatron["before"], mask) > 20 * STEP_LOGP_TOL


def test_sync_into_the_embedded_engine_verifies_and_a_stale_engine_is_caught(world_one):
    pair, first_sync, _ = world_one  # the fixture updated the trainer after its sync of version 1
    assert first_sync["sync/num_tensors"] > 0 and first_sync["sync/gather_s"] > 0
    with pytest.raises(SyncError, match="differ from the trainer's"):
        pair.verify_engine_matches_trainer()  # the engine still serves version 1
    metrics = pair.sync(2)
    pair.verify_engine_matches_trainer()
    assert metrics["sync/version"] == 2 and ray.get(pair.engine.weight_version.remote()) == 2


def test_save_then_load_restores_the_step_and_the_next_update(world_one, batch, tmp_path):
    pair, _, _ = world_one
    trainer = pair.trainer
    path = tmp_path / "trainer.pt"
    sha = ray.get(trainer.save_state.remote(str(path)))
    assert sha256_file(path) == sha
    manifest = json.loads(path.read_text())
    saved_step = manifest["step"]
    ahead = ray.get(trainer.train_step.remote(batch))
    assert ahead["step"] == saved_step + 1
    assert ray.get(trainer.load_state.remote(str(path))) == saved_step
    again = ray.get(trainer.train_step.remote(batch))
    assert again == ahead  # the same update from the restored weights and Adam moments, bit for bit
    # a damaged shard is refused by name before megatron reads anything
    shard = next(n for n in manifest["files"] if n.endswith(".distcp"))
    target = path.parent / manifest["directory"] / shard
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0x10
    target.write_bytes(bytes(data))
    with pytest.raises(ray.exceptions.RayTaskError, match=f"{shard}: sha256 differs"):
        ray.get(trainer.load_state.remote(str(path)))


def test_checkpoint_load_boots_the_saved_weights_and_the_kl_reference_is_them(
    world_one, spec, batch, tmp_path
):
    """checkpoint.load: a new world boots from a saved checkpoint instead of the HF one (its step
    starts at 0); with algorithm.kl_coef > 0 the KL reference is that starting policy, so the
    first step's KL is 0."""
    pair, _, _ = world_one
    path = tmp_path / "trainer.pt"
    ray.get(pair.trainer.save_state.remote(str(path)))
    saved = ray.get(pair.trainer.logprobs.remote(batch.input_ids, batch.attention_mask))
    kwargs = megatron_trainer_kwargs(spec)
    kwargs.update(load_path=str(path), algorithm_cfg=dataclasses.replace(spec.algorithm, kl_coef=0.1))
    worker = ray.remote(MegatronTrainerWorker).options(num_cpus=0, max_restarts=0).remote(**kwargs)
    try:
        booted = ray.get(worker.logprobs.remote(batch.input_ids, batch.attention_mask))
        # a resume loads into an optimizer that has not stepped yet (no Adam state to load into)
        resumed_step = ray.get(worker.load_state.remote(str(path)))
        metrics = ray.get(worker.train_step.remote(batch))
    finally:
        ray.get(worker.close.remote())
        ray.kill(worker)
    assert torch.equal(booted, saved)
    assert resumed_step == json.loads(path.read_text())["step"] and metrics["step"] == resumed_step + 1
    assert metrics["kl"] == 0.0


LAYOUTS = {
    "tp2_sp_etp2": {"tp": 2, "sequence_parallel": True, "etp": 2},
    # experts replicated across the TP ranks, each routing its half of the sequence: at ep = 1 their
    # gradients reach the other TP rank only through model.mark_experts_expert_data_parallel
    "tp2_sp_etp1": {"tp": 2, "sequence_parallel": True, "etp": 1},
    "tp2_sp_ep2_etp1": {"tp": 2, "sequence_parallel": True, "ep": 2, "etp": 1},
    "ep2": {"ep": 2, "dp": 2},
    "dp2": {"dp": 2},
}


@pytest.mark.parametrize("layout", LAYOUTS, ids=list(LAYOUTS))
def test_two_rank_layouts_equal_world_size_one(world_one, spec, batch, layout):
    _, _, reference = world_one
    kwargs = megatron_trainer_kwargs(spec)
    kwargs["parallel_cfg"] = dataclasses.replace(spec.parallel, **LAYOUTS[layout])
    # a secret trainer variable rank 0 holds reaches the peer rank through its own owner-only file
    # (start-up checks it arrived and fails naming the rank otherwise)
    kwargs["peer_secret_env_names"] = ("SKYQ_TEST_PEER_SECRET",)
    options = {"num_cpus": 0, "max_restarts": 0, "runtime_env": {"env_vars": {"SKYQ_TEST_PEER_SECRET": "s3"}}}
    worker = ray.remote(MegatronTrainerWorker).options(**options).remote(**kwargs)
    try:
        assert ray.get(worker.build_seconds.remote()) > 0
        # the export is a collective of both ranks: the same wire as world size 1's from the same weights
        assert ray.get(worker.serialized_digest.remote()) == world_one[1]["digest"]
        mine = _run(worker, batch)
    finally:
        ray.get(worker.close.remote())
        ray.kill(worker)
    mask = batch.attention_mask.float()
    assert _max_diff(mine["before"], reference["before"], mask) < LOGP_TOL
    for key in ("loss", "pg_loss", "mismatch_mean_abs"):
        assert mine["metrics"][key] == pytest.approx(reference["metrics"][key], rel=1e-5, abs=1e-6), key
    assert mine["metrics"]["grad_norm"] == pytest.approx(reference["metrics"]["grad_norm"], rel=1e-5)
    assert _max_diff(mine["after"], reference["after"], mask) < STEP_LOGP_TOL


def test_a_torch_trainer_state_is_not_loaded_as_a_megatron_checkpoint(tmp_path):
    from skyq.trainer.megatron.worker import verified_directory

    path = tmp_path / "trainer.pt"
    torch.save({"trainer": {}}, path)
    with pytest.raises(MegatronCheckpointError, match="trainer=torch trainer.pt does not load"):
        verified_directory(path)


def test_export_items_stack_each_projection_of_the_routed_experts_in_the_layout_order(spec):
    from skyq.quant.layouts import get_layout
    from skyq.trainer.megatron.worker import stacked_items

    layout = get_layout(spec.model.family)
    specs = list(layout.hf_parameters(spec.model))
    tensors = {s.name: torch.randn(s.shape) for s in specs}
    items = list(
        stacked_items(reversed(list(tensors.items())), spec.model, layout)
    )  # the export's order differs
    names = [n for item in items for n in ((item[0],) if isinstance(item[0], str) else item[0])]
    assert sorted(names) == sorted(s.name for s in specs)  # each tensor once
    firsts = [item[0] if isinstance(item[0], str) else item[0][0] for item in items]
    assert firsts == [s.name for s in specs if s.name in set(firsts)]  # a stack where its first expert is
    stacks = [item for item in items if not isinstance(item[0], str)]
    assert len(stacks) == 3 * spec.model.num_layers  # gate, up, down per MoE layer
    for stack_names, stack in stacks:
        assert len(stack_names) == spec.model.num_experts
        assert torch.equal(stack, torch.stack([tensors[n] for n in stack_names]))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"parallel": {"cp": 2}}, "topology.parallel.cp=2"),
        ({"parallel": {"tp": 2, "etp": 2}}, "topology.parallel.tp=2 without sequence parallelism"),
        (
            {"optimizer": {"cpu_offload": True, "precision_aware": True}},
            "trainer.optimizer.cpu_offload=true on topology.device=cpu",
        ),
        (
            {"optimizer": {"cpu_offload": True}},
            "cpu_offload=true needs trainer.optimizer.precision_aware=true",
        ),
        (
            {"optimizer": {"precision_aware": True}},
            "trainer.optimizer.precision_aware=true needs Transformer",
        ),
        ({"optimizer": {"overlap_cpu_offload": True}}, "set trainer.optimizer.cpu_offload=true too"),
    ],
)
def test_what_this_trainer_cannot_run_is_refused_naming_the_key(spec, change, message):
    from skyq.trainer.megatron.trainer import check_supported

    parallel = dataclasses.replace(spec.parallel, **change.get("parallel", {}))
    optimizer = dataclasses.replace(spec.trainer.optimizer, **change.get("optimizer", {}))
    with pytest.raises(ValueError, match=message):
        check_supported(parallel_cfg=parallel, optimizer_cfg=optimizer, device="cpu")
    check_supported(parallel_cfg=spec.parallel, optimizer_cfg=spec.trainer.optimizer, device="cpu")


@pytest.mark.parametrize("layout", ["tp2_sp_etp1", "tp2_sp_ep2_etp1"])
def test_validate_and_the_trainer_take_the_replicated_expert_layouts(spec, layout):
    from skyq.config.validate import validate
    from skyq.trainer.megatron.trainer import check_supported

    overrides = [f"topology.parallel.{k}={str(v).lower()}" for k, v in LAYOUTS[layout].items()]
    cfg = to_object(compose(OVERRIDES + overrides))
    validate(cfg)
    assert (cfg.topology.parallel.tp, cfg.topology.parallel.etp) == (2, 1)
    check_supported(parallel_cfg=cfg.topology.parallel, optimizer_cfg=cfg.trainer.optimizer, device="cpu")


def test_a_peer_rank_that_fails_is_named_without_waiting_for_rank_0(cluster, spec):
    """Rank 1 cannot join the world (its gloo has no such interface): the worker's start-up fails
    naming rank 1 at once, not after rank 0's rendezvous times out."""
    kwargs = megatron_trainer_kwargs(spec)
    kwargs.update(
        parallel_cfg=dataclasses.replace(spec.parallel, dp=2),
        peer_env={"GLOO_SOCKET_IFNAME": "skyq-no-such-if"},
        timeout_s=300.0,
    )
    worker = ray.remote(MegatronTrainerWorker).options(num_cpus=0, max_restarts=0).remote(**kwargs)
    start = time.perf_counter()
    try:
        with pytest.raises(ray.exceptions.RayActorError, match="rank 1 of 2: start-up failed"):
            ray.get(worker.build_seconds.remote())
    finally:
        ray.kill(worker)
    assert time.perf_counter() - start < 120
