"""Pipeline parallelism combined with tensor or expert parallelism in trainer=megatron on the CPU:
four gloo ranks, tiny Qwen3-MoE and tiny MLA (DeepSeek-V3 family) models.

Layouts (megatron-core's rank order tp-cp-ep-dp-pp: ranks 0, 1 are stage 0, ranks 2, 3 stage 1):
- PP2 x TP2 with sequence parallelism and ETP2 (dp 1): TP groups {0, 1}, {2, 3}; pipelines {0, 2}, {1, 3}.
- PP2 x EP2, dp 2 (the experts' EP group is the DP group of a stage): each stage's two ranks hold
  half of that stage's experts and half of its batch rows.
- Qwen3-MoE also at PP2 x TP2 + SP with ETP1 (each TP rank holds whole experts) and with EP2 ETP1
  (the TP pair splits the experts): the etp != tp layouts of tests/megatron/test_worker.py, staged.

For each, one spawned world of four ranks (megatron-core imported once per rank) checks:
- HF -> Megatron: every rank's tensors are its stage's layers and its TP / ETP / EP shard of the
  pure `hf_to_megatron` tensors; the export gives the checkpoint back bit for bit, whole, in the
  same order on all four ranks (the layout's order at ep 1); also with uneven stages (3 layers: the
  first stage 1 at TP2, the last stage 1 at EP2, where both stages hold routed experts).
- `MegatronTrainer` scores, updates and reports the grad norm like world size 1 from the same
  checkpoint, within tests/megatron/test_pp.py's tolerances (every rank's share of the rows; the
  step's loss from the shares the worker assembles); a dist-checkpoint save -> load restores the
  next update bit for bit.
The world-size-1 references run on rank 0 of the same spawned world after the four-rank trainers:
the module's CI tests are one spawn (~45 s on an idle 2-core CPU, ~80 s on a busy one, most of it
four megatron-core imports). Marked slow (not in CI, ~70 s): PP2 x EP2 through the worker (rank 0
a Ray actor with three peer actors) against a world-size-1 worker.

Version detail: on megatron-core 0.16.1 (the CPU pin) the MLA model at PP2 x EP2 saves and loads
only with `cpu_compat`'s `DistributedOptimizer.state_dict` patch: its first stage (one dense layer)
holds no routed expert, yet gets an expert optimizer with empty groups, whose state_dict asserted.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed (dev extra, Python < 3.12)")

from dist_helpers import init_parallel, run_ranks  # noqa: E402  (tests/megatron is on sys.path)
from mapping_helpers import (  # noqa: E402
    TRAINER,
    cpu_trainer,
    deepseek_cfg,
    qwen_cfg,
    resumes_bit_for_bit,
    write_checkpoint,
)
from test_pp import LOGP_TOL, STEP_LOGP_TOL, _losses, make_batch, small_hf  # noqa: E402

from skyq.config.schema import ModelConfig, ParallelConfig, PrecisionConfig  # noqa: E402

WORLD = 4
LAYOUTS = {
    "tp2": {"tp": 2, "etp": 2, "sequence_parallel": True, "dp": 1},
    "ep2": {"ep": 2, "dp": 2},
    # the experts whole on each TP rank (model.mark_experts_expert_data_parallel), and split over them
    "tp2_etp1": {"tp": 2, "etp": 1, "sequence_parallel": True, "dp": 1},
    "tp2_ep2_etp1": {"tp": 2, "ep": 2, "etp": 1, "sequence_parallel": True, "dp": 1},
}
MODELS = {"qwen_tied": qwen_cfg(tie_word_embeddings=True), "mla": deepseek_cfg()}
CASES = [  # (model, layout); the MLA model's first layer is dense: stage 0 holds no routed expert
    ("qwen_tied", "tp2"),
    ("qwen_tied", "ep2"),
    ("mla", "tp2"),
    ("mla", "ep2"),
    ("qwen_tied", "tp2_etp1"),
    ("qwen_tied", "tp2_ep2_etp1"),
]


UNEVEN = {  # load / export only: (model, layout, first_stage_layers, last_stage_layers)
    "qwen_3_layers_first_1/tp2": (qwen_cfg(num_layers=3), "tp2", 1, None),
    "mla_3_layers_last_1/ep2": (deepseek_cfg(num_layers=3), "ep2", None, 1),  # experts on both stages
}
LOAD_CASES = {f"{m}/{x}": (MODELS[m], x, None, None) for m, x in CASES} | UNEVEN
STAGE_LAYERS = {  # global decoder layers of each stage (ranks 0, 1 are stage 0)
    **{case: ([0], [1]) for case in LOAD_CASES if case not in UNEVEN},
    "qwen_3_layers_first_1/tp2": ([0], [1, 2]),
    "mla_3_layers_last_1/ep2": ([0, 1], [2]),
}


def _parallel(layout: str, first: int | None = None, last: int | None = None) -> ParallelConfig:
    return ParallelConfig(pp=2, first_stage_layers=first, last_stage_layers=last, **LAYOUTS[layout])


def _load_export(rank: int, model_cfg: ModelConfig, parallel: ParallelConfig, hf_dir: str) -> dict:
    """At `parallel` (PP2): load, check every tensor against the pure conversion's shard, export;
    (this stage's global layers, exported names). Asserts the export equals the checkpoint."""
    from megatron.core import parallel_state as ps
    from safetensors.torch import load_file

    from skyq.trainer.megatron.mapping import (
        export_hf,
        global_name,
        hf_to_megatron,
        load_hf_checkpoint,
        model_tensors,
        shard,
    )
    from skyq.trainer.megatron.model import build_model

    layout = f"tp{parallel.tp} ep{parallel.ep}"
    init_parallel(tp=parallel.tp, ep=parallel.ep, etp=parallel.etp, pp=2)
    original: dict[str, torch.Tensor] = {}
    for file in sorted(Path(hf_dir).glob("*.safetensors")):
        original.update(load_file(str(file)))
    model = build_model(model_cfg, PrecisionConfig(), TRAINER, parallel, device="cpu", seed=0)
    load_hf_checkpoint(model, hf_dir, model_cfg, "local")
    full = hf_to_megatron(original, model_cfg, "local")
    ranks = dict(
        tp_rank=ps.get_tensor_model_parallel_rank(), tp_size=parallel.tp,
        ep_rank=ps.get_expert_model_parallel_rank(), ep_size=parallel.ep,
        etp_rank=ps.get_expert_tensor_parallel_rank(), etp_size=ps.get_expert_tensor_parallel_world_size(),
    )  # fmt: skip
    where = f"{layout} rank {rank}"
    tensors = model_tensors(model)
    for local, tensor in tensors.items():
        name = global_name(local, model_cfg, ranks["ep_rank"], parallel.ep)
        source = "embedding.word_embeddings.weight" if (
            name == "output_layer.weight" and model_cfg.tie_word_embeddings
        ) else name  # fmt: skip
        expected = shard(source, full[source], model_cfg, **ranks)
        assert expected is not None, f"{where}: {local} is not this rank's"
        assert torch.equal(tensor.detach(), expected.to(tensor.dtype)), f"{where}: {local} loaded wrong"
    layers = sorted({int(n.split(".")[2]) for n in tensors if n.startswith("decoder.layers.")})
    assert ("embedding.word_embeddings.weight" in tensors) == ps.is_pipeline_first_stage(), where
    assert ("output_layer.weight" in tensors) == ps.is_pipeline_last_stage(), where
    exported = list(export_hf(model, model_cfg, "local"))
    names = [n for n, _ in exported]
    assert len(names) == len(set(names)) and set(names) == set(original), (
        f"{where}: missing {sorted(set(original) - set(names))[:3]}, extra {sorted(set(names) - set(original))[:3]}"
    )
    for name, tensor in exported:
        assert tensor.dtype == original[name].dtype and torch.equal(tensor, original[name]), (
            f"{where}: {name} differs"
        )
    return {"layers": layers, "names": names}


def _trainer(model_cfg, hf_dir, parallel, *, rank, world_size, store):
    # one row per micro-batch: every DP rank pipelines at least two micro-batches (1F1B)
    return cpu_trainer(
        model_cfg, hf_dir, parallel, rank=rank, world_size=world_size, store=store, micro_batch_size=1
    )


def _shared_store(rank: int):
    """A TCP store of the four ranks on a port rank 0's store picked (sent over the default group):
    each trainer's world rendezvouses under its own prefix of it."""
    import torch.distributed as dist

    port = torch.zeros(1, dtype=torch.int64)
    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, WORLD, is_master=True, use_libuv=False, wait_for_workers=False)
        port[0] = store.port
    dist.broadcast(port, 0)
    if rank != 0:
        store = dist.TCPStore("127.0.0.1", int(port), WORLD, is_master=False, use_libuv=False)
    return store


def _steps(trainer, batch, directory: str) -> dict:
    """Log-probs, one update, log-probs after it; then save, step, load, step (the two agree)."""

    before = trainer.logprobs(batch.input_ids, batch.attention_mask)
    step = trainer.train_step(batch)
    after = trainer.logprobs(batch.input_ids, batch.attention_mask)
    resumed_equal = resumes_bit_for_bit(trainer, batch, directory, trainer.rank)
    return {
        "dp_rank": step["dp_rank"], "start": step["start"], "before": before["logp"], "step_logp": step["logp"],
        "grad_norm": step["grad_norm"], "after": after["logp"],
        "resumed_equal": resumed_equal,
    }  # fmt: skip


def combined_world(rank: int, hf_dirs: dict[str, str], ckpt: str) -> dict:
    """Every case's load / export, then every case's four-rank trainer, then (rank 0 alone) each
    model's world-size-1 trainer."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    out: dict = {"load_export": {}, "trainer": {}, "ws1": {}}
    for case, (model_cfg, layout, first, last) in LOAD_CASES.items():
        parallel = _parallel(layout, first, last)
        out["load_export"][case] = _load_export(rank, model_cfg, parallel, hf_dirs[case.split("/")[0]])
    ps.destroy_model_parallel()
    store = _shared_store(rank)
    dist.destroy_process_group()  # each trainer joins its own world
    for model, layout in CASES:
        batch = make_batch(MODELS[model].vocab_size)
        prefixed = dist.PrefixStore(f"{model}/{layout}", store)
        parallel = _parallel(layout)
        trainer = _trainer(
            MODELS[model], hf_dirs[model], parallel, rank=rank, world_size=WORLD, store=prefixed
        )
        out["trainer"][f"{model}/{layout}"] = _steps(trainer, batch, f"{ckpt}/{model}_{layout}")
        trainer.close()
    for model, cfg in MODELS.items():
        if rank == 0:
            batch = make_batch(cfg.vocab_size)
            one = dist.HashStore()
            trainer = _trainer(cfg, hf_dirs[model], ParallelConfig(dp=1), rank=0, world_size=1, store=one)
            before = trainer.logprobs(batch.input_ids, batch.attention_mask)["logp"]
            step = trainer.train_step(batch)
            after = trainer.logprobs(batch.input_ids, batch.attention_mask)["logp"]
            out["ws1"][model] = {
                "before": before,
                "step_logp": step["logp"],
                "grad_norm": step["grad_norm"],
                "after": after,
            }
            trainer.close()
    if not dist.is_initialized():  # dist_helpers' teardown destroys the default group
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pp_combined")
    models = MODELS | {case.split("/")[0]: cfg for case, (cfg, *_) in UNEVEN.items()}
    hf_dirs = {
        model: str(write_checkpoint(tmp / model, small_hf(cfg, seed=50 + i)))
        for i, (model, cfg) in enumerate(models.items())
    }
    (tmp / "ckpt").mkdir()
    return run_ranks(combined_world, WORLD, hf_dirs, str(tmp / "ckpt"))


@pytest.mark.parametrize("case", LOAD_CASES, ids=[c.replace("/", "-") for c in LOAD_CASES])
def test_each_stage_and_shard_loads_and_the_export_is_the_whole_checkpoint(results, case):
    from skyq.trainer.megatron.mapping.tables import hf_text_specs

    model_cfg, layout, _, _ = LOAD_CASES[case]
    by_rank = [r["load_export"][case] for r in results]
    first, last = STAGE_LAYERS[case]
    assert [r["layers"] for r in by_rank] == [first, first, last, last], case
    names = by_rank[0]["names"]
    assert all(r["names"] == names for r in by_rank), f"{case}: the ranks export in different orders"
    layout_order = list(hf_text_specs(model_cfg))
    if LAYOUTS[layout].get("ep", 1) == 1:
        assert names == layout_order, case
    else:  # grouped by layer; local expert i of every EP rank before i + 1 (experts 0, 2, 1, 3)
        layer_of = [int(n.split("layers.")[1].split(".")[0]) for n in names if ".layers." in n]
        assert layer_of == sorted(layer_of), case
        experts = [n.split("experts.")[1].split(".")[0] for n in names if ".mlp.experts." in n]
        assert experts[:12:3] == ["0", "2", "1", "3"], experts[:12]


@pytest.mark.parametrize(("model", "layout"), CASES, ids=[f"{m}-{x}" for m, x in CASES])
def test_the_combined_layout_trains_like_world_size_one_and_resumes_bit_for_bit(results, model, layout):
    from skyq.trainer.megatron.worker import _by_dp_rank

    case = f"{model}/{layout}"
    batch = make_batch(MODELS[model].vocab_size)
    ws1 = results[0]["ws1"][model]
    for rank in range(WORLD):
        mine = results[rank]["trainer"][case]
        rows = slice(mine["start"], mine["start"] + len(mine["before"]))
        assert len(mine["before"]) == len(batch) // LAYOUTS[layout]["dp"], f"{case} rank {rank}"
        mask = batch.attention_mask[rows].float()
        for key, tol in (("before", LOGP_TOL), ("step_logp", LOGP_TOL), ("after", STEP_LOGP_TOL)):
            diff = float(((mine[key] - ws1[key][rows]).abs() * mask).max())
            assert diff < tol, f"{case} rank {rank} {key}: {diff:.3g}"
        assert mine["grad_norm"] == pytest.approx(ws1["grad_norm"], rel=1e-5), f"{case} rank {rank}"
        assert mine["resumed_equal"], f"{case} rank {rank}: the update after load differs"
    # the rows the worker assembles from the DP shares (rank 0 has the first): the step's loss
    shares = _by_dp_rank([results[rank]["trainer"][case] for rank in range(WORLD)])
    step_logp = torch.cat([share["step_logp"] for share in shares])
    mine, theirs = _losses(step_logp, batch), _losses(ws1["step_logp"], batch)
    assert mine == pytest.approx(theirs, rel=1e-5, abs=1e-6), case
    mask = batch.attention_mask.float()
    assert float(((ws1["after"] - ws1["before"]).abs() * mask).max()) > 20 * STEP_LOGP_TOL, model


# --- config ----------------------------------------------------------------------------------------


def test_validate_takes_the_combined_cpu_layouts_and_the_worker_starts_four_ranks():
    from skyq.config.store import compose, to_object
    from skyq.config.validate import ConfigValidationError, validate
    from skyq.trainer.megatron.worker import world_layout, world_size

    def cfg(*parallel):
        overrides = ["trainer=megatron", "precision=bf16", "model=small_moe", "topology=cpu"]
        return to_object(compose(overrides + [f"topology.parallel.{p}" for p in ("pp=2", *parallel)]))

    for layout in LAYOUTS.values():
        config = cfg(*(f"{k}={str(v).lower()}" for k, v in layout.items() if k != "dp" or v != 1))
        validate(config)
        resolved = world_layout(config.topology.parallel, device="cpu", trainer_gpus=0)
        assert world_size(resolved) == WORLD and resolved.dp == layout["dp"], layout
    # EP2 shards the experts over a stage's DP ranks: on the CPU dp=null is 1, so one rank per stage
    with pytest.raises(
        ConfigValidationError, match=r"ep\*etp = 2\*1 must divide tp\*cp\*dp = 1 .*dp=null means 1"
    ):
        validate(cfg("ep=2"))


# --- through the worker (Ray actors) ---------------------------------------------------------------


@pytest.mark.slow  # four Ray actors, each importing megatron-core: ~50 s on an idle 2-core CPU on top of
# the module's spawned world; the trainer at both layouts is checked by the tests above in CI
def test_rank_0_of_a_pp2_ep2_worker_returns_what_world_size_one_does(tmp_path):
    """The run loop's view at PP2 x EP2 (dp 2, the tiny MLA model): rank 0 (a Ray actor) starts
    three peer actors, assembles the two DP shares' log-probs and the step's metrics, and sends the
    same wire as a world-size-1 worker."""
    pytest.importorskip("ray")
    from test_pp_worker import _run

    from skyq.launch.ray_local import local_ray

    model_cfg = MODELS["mla"]
    hf_dir = str(write_checkpoint(tmp_path / "mla", small_hf(model_cfg, seed=60)))
    with local_ray(num_cpus=2):
        one = _run(model_cfg, hf_dir, ParallelConfig())
        four = _run(model_cfg, hf_dir, ParallelConfig(pp=2, ep=2, dp=2))
    assert four["digest"] == one["digest"]
    mask = make_batch(model_cfg.vocab_size).attention_mask.float()
    assert float(((four["before"] - one["before"]).abs() * mask).max()) < LOGP_TOL
    for key in ("loss", "pg_loss", "mismatch_mean_abs"):
        assert four["metrics"][key] == pytest.approx(one["metrics"][key], rel=1e-5, abs=1e-6), key
    assert four["metrics"]["grad_norm"] == pytest.approx(one["metrics"]["grad_norm"], rel=1e-5)
    assert float(((four["after"] - one["after"]).abs() * mask).max()) < STEP_LOGP_TOL
    assert float(((one["after"] - one["before"]).abs() * mask).max()) > 20 * STEP_LOGP_TOL
