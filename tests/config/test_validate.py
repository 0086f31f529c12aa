"""Each cross-field rule, with a bad config whose message names the keys and the fix."""

from __future__ import annotations

import json

import pytest

from skyq.config.store import compose, to_object
from skyq.config.validate import ConfigValidationError, validate


def _cfg(*overrides):
    return to_object(compose(list(overrides)))


def _refused(cfg, *needles):
    with pytest.raises(ConfigValidationError) as info:
        validate(cfg)
    for needle in needles:
        assert needle in str(info.value), str(info.value)
    return str(info.value)


def _ckpt(path, quantization_config=None, nested=False):
    path.mkdir(parents=True)
    cfg = {"model_type": "qwen3_moe"}
    if quantization_config is not None:
        if nested:
            cfg["text_config"] = {"quantization_config": quantization_config}
        else:
            cfg["quantization_config"] = quantization_config
    (path / "config.json").write_text(json.dumps(cfg))
    return str(path)


def _int4_block(symmetric=True, group_size=128):
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {
                    "num_bits": 4,
                    "type": "int",
                    "symmetric": symmetric,
                    "strategy": "group",
                    "group_size": group_size,
                    "dynamic": False,
                    "observer": "minmax",
                },
                "input_activations": None,
            }
        },
        "ignore": ["lm_head"],
    }


QWEN_INT4 = ["recipe=qwen3_30b_int4_qat_8gpu"]
AT_SCALE = ["model=qwen3_30b", "topology=8gpu", "trainer=megatron", "rollout=vllm"]
"""The backends a topology=8gpu layout is for (trainer=torch reads none of topology.parallel)."""
TINY_VLLM = ["topology=1gpu", "trainer=megatron", "rollout=vllm"]
"""tiny_moe on the backends that read checkpoint.rollout_checkpoint."""


def test_int4_rollout_checkpoint_must_be_symmetric_with_reconvert_command(tmp_path):
    ckpt = _ckpt(tmp_path / "int4", _int4_block(symmetric=False))
    msg = _refused(
        _cfg(*QWEN_INT4, f"checkpoint.rollout_checkpoint={ckpt}"),
        "checkpoint.rollout_checkpoint",
        "asymmetric",
    )
    assert "python -m skyq.tools.convert_hf_to_int4" in msg and "--group-size 128" in msg


def test_int4_symmetric_checkpoint_with_matching_group_is_accepted(tmp_path):
    ckpt = _ckpt(tmp_path / "int4", _int4_block(), nested=True)
    bf16 = _ckpt(tmp_path / "bf16")
    report = validate(
        _cfg(
            *QWEN_INT4,
            f"checkpoint.rollout_checkpoint={ckpt}",
            f"checkpoint.hf_checkpoint={bf16}",
            f"checkpoint.ref_load={bf16}",
        )
    )
    assert report.skipped == []


def test_int4_group_size_must_equal_the_checkpoints(tmp_path):
    ckpt = _ckpt(tmp_path / "int4", _int4_block(group_size=32))
    _refused(
        _cfg(*QWEN_INT4, f"checkpoint.rollout_checkpoint={ckpt}"),
        "group_size=32",
        "precision.int4_group_size=128",
    )


def test_swapped_roles_trainer_checkpoint_that_is_w4a16_is_refused(tmp_path):
    int4 = _ckpt(tmp_path / "int4", _int4_block())
    bf16 = _ckpt(tmp_path / "bf16")
    msg = _refused(
        _cfg(*QWEN_INT4, f"checkpoint.hf_checkpoint={int4}", f"checkpoint.rollout_checkpoint={bf16}"),
        "checkpoint.hf_checkpoint",
        "BF16",
    )
    assert "swap" in msg


def test_bf16_rollout_checkpoint_for_a_quantized_precision_is_refused(tmp_path):
    bf16 = _ckpt(tmp_path / "bf16")
    msg = _refused(
        _cfg("recipe=qwen3_30b_fp8_blockwise_8gpu", f"checkpoint.rollout_checkpoint={bf16}"),
        "checkpoint.rollout_checkpoint",
        "BF16",
        "drop every quantized push",
    )
    assert "convert_hf_to_fp8" in msg


def test_fp8_rollout_checkpoint_block_size_must_match(tmp_path):
    fp8 = _ckpt(
        tmp_path / "fp8",
        {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [64, 64]},
    )
    _refused(
        _cfg("recipe=qwen3_30b_fp8_blockwise_8gpu", f"checkpoint.rollout_checkpoint={fp8}"),
        "weight_block_size=[64, 64]",
        "precision.block_size=[128, 128]",
    )
    ok = _ckpt(tmp_path / "fp8ok", {"quant_method": "fp8", "weight_block_size": [128, 128]})
    validate(_cfg("recipe=qwen3_30b_fp8_blockwise_8gpu", f"checkpoint.rollout_checkpoint={ok}"))


def test_missing_checkpoint_paths_are_reported_as_skipped_checks():
    report = validate(_cfg(*QWEN_INT4))
    assert len(report.skipped) == 3
    assert any("checkpoint.rollout_checkpoint" in s and "was not checked" in s for s in report.skipped)


def test_delta_sync_with_quantized_wire_is_refused():
    _refused(
        _cfg("precision=fp8_blockwise", "rollout.weight_sync.mode=delta"),
        "rollout.weight_sync.mode=delta",
        "precision.name=fp8_blockwise",
    )
    validate(_cfg(*AT_SCALE, "precision=bf16", "rollout.weight_sync.mode=delta"))


def test_mxfp8_with_persistent_fp8_params_is_refused():
    _refused(
        _cfg("precision=mxfp8", "precision.persistent_fp8_params=true"),
        "precision.persistent_fp8_params=true",
    )


def test_parallel_product_must_equal_trainer_gpus():
    _refused(
        _cfg(*AT_SCALE, "topology.parallel.tp=2", "topology.parallel.dp=2"),
        "tp*pp*cp*dp = 2*1*1*2 = 4",
        "topology.trainer_gpus=8",
    )
    _refused(_cfg(*AT_SCALE, "topology.parallel.tp=3"), "not divisible by tp*pp*cp")


def test_ep_must_divide_experts():
    _refused(
        _cfg(*AT_SCALE, "topology.parallel.ep=3"),
        "topology.parallel.ep=3 does not divide model.num_experts=128",
    )


def test_engines_times_gpus_per_engine_must_equal_rollout_gpus():
    _refused(
        _cfg(*AT_SCALE, "rollout.gpus_per_engine=3"),
        "topology.rollout_gpus=8",
        "rollout.gpus_per_engine=3",
    )


def test_colocated_needs_the_same_gpus():
    _refused(_cfg(*AT_SCALE, "topology.rollout_gpus=4"), "topology.placement=colocated")


def test_split_placement_must_add_up():
    validate(
        _cfg(
            *AT_SCALE,
            "topology.placement=split",
            "topology.trainer_gpus=4",
            "topology.rollout_gpus=4",
            "topology.parallel.ep=4",
        )
    )
    _refused(
        _cfg(
            *AT_SCALE,
            "topology.placement=split",
            "topology.trainer_gpus=4",
            "topology.rollout_gpus=2",
            "topology.parallel.ep=4",
        ),
        "topology.placement=split",
    )


def test_256_gpu_kimi_layout_is_valid():
    cfg = _cfg("recipe=kimi_k26_int4_qat_256gpu_text")
    validate(cfg)


def test_shard_divisibility_shows_the_arithmetic():
    msg = _refused(
        _cfg("recipe=qwen3_30b_fp8_blockwise_8gpu", "rollout.gpus_per_engine=4"),
        "model.moe_intermediate_size=768 / 4",
        "= 192",
        "NOT a multiple of 128",
    )
    assert "{1, 2, 3, 6}" in msg and "EP" in msg


def test_mxfp8_trainer_shards_must_be_multiples_of_32():
    _refused(
        _cfg(
            "precision=mxfp8",
            *AT_SCALE,
            "topology.parallel.etp=5",
            "topology.parallel.tp=5",
            "topology.parallel.dp=null",
            "topology.trainer_gpus=5",
            "topology.rollout_gpus=5",
            "topology.gpus_per_node=5",
            "topology.parallel.ep=1",
        ),
        "topology.parallel.etp",
    )


def test_group_size_must_divide_k():
    _refused(
        _cfg("precision=int4_qat", "precision.int4_group_size=128"),
        "model.hidden_size=64",
        "precision.int4_group_size",
    )


def test_prompt_plus_response_within_max_positions():
    _refused(
        _cfg("task.max_prompt_length=400", "task.max_response_length=200"),
        "task.max_prompt_length + task.max_response_length = 400 + 200 = 600",
        "model.max_position_embeddings=512",
    )


def test_what_the_gpu_stacks_cannot_do_on_a_cpu_topology_is_refused():
    """Megatron runs on the CPU (gloo ranks as Ray actors) but its FP8 needs Transformer Engine, so a
    GPU; vLLM has a CPU build (what it cannot serve there is refused before the run starts:
    tests/launch/test_vllm_choice.py)."""
    _refused(_cfg("trainer=megatron"), "precision=fp8_blockwise with trainer=megatron", "topology.device=cpu")
    validate(
        _cfg(
            "trainer=megatron",
            "precision=bf16",
            "topology.parallel.tp=2",
            "topology.parallel.ep=2",
            "topology.parallel.sequence_parallel=true",
        )
    )
    _refused(
        _cfg("trainer=megatron", "precision=bf16", "topology.parallel.tp=2", "topology.parallel.ep=2"),
        "Fix: topology.parallel.sequence_parallel=true",
    )
    _refused(_cfg("trainer=megatron", "precision=bf16", "topology.parallel.ep=3"), "ep*etp = 3*1 must divide")
    _refused(_cfg("trainer=torch", "topology.parallel.tp=2"), "trainer=megatron for a parallel layout")
    validate(_cfg("rollout=vllm", "precision=bf16"))


def test_all_errors_are_reported_at_once():
    with pytest.raises(ConfigValidationError) as info:
        validate(
            _cfg(
                *AT_SCALE,
                "precision=mxfp8",
                "precision.persistent_fp8_params=true",
                "rollout.weight_sync.mode=delta",
            )
        )
    assert len(info.value.errors) == 2


def test_qat_scope_must_equal_what_the_rollout_checkpoint_quantizes(tmp_path):
    """A checkpoint whose ignore list leaves attention quantized disagrees with routed-expert-only QAT."""
    from skyq import preflight
    from skyq.quant.plan import build_plan

    cfg = _cfg("precision=int4_qat")
    plan = build_plan(cfg.model, cfg.precision)
    good = _int4_block(group_size=32)
    good["ignore"] = plan.ignore_list()
    ok = _ckpt(tmp_path / "ok", good)
    cfg_ok = _cfg(*TINY_VLLM, "precision=int4_qat", f"checkpoint.rollout_checkpoint={ok}")
    validate(cfg_ok)
    assert (
        preflight.plan_errors(model=cfg_ok.model, precision=cfg_ok.precision, checkpoint=cfg_ok.checkpoint)
        == []
    )
    bad = _int4_block(group_size=32)
    bad["ignore"] = ["lm_head"]  # attention and router left quantized
    path = _ckpt(tmp_path / "bad", bad)
    cfg_bad = _cfg(*TINY_VLLM, "precision=int4_qat", f"checkpoint.rollout_checkpoint={path}")
    with pytest.raises(ConfigValidationError, match="precision.qat_scope=routed_experts"):
        preflight.check(cfg_bad)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("algorithm.num_steps=0", "algorithm.num_steps=0 must be >= 1 (Training steps"),
        ("algorithm.num_steps=-1", "algorithm.num_steps=-1 must be >= 1"),
        ("algorithm.global_batch_size=0", "algorithm.global_batch_size=0 must be >= 1"),
        ("algorithm.group_size=1", "algorithm.group_size=1 must be >= 2 (Responses sampled per prompt)"),
        ("algorithm.lr=0", "algorithm.lr=0.0 must be > 0"),
        ("algorithm.clip_eps_low=1.0", "algorithm.clip_eps_low=1.0 must be in (0, 1)"),
        ("rollout.temperature=0", "rollout.temperature=0.0 must be > 0 (Sampling temperature)"),
        ("rollout.top_p=1.5", "rollout.top_p=1.5 must be in (0, 1]"),
        ("rollout.gpu_memory_fraction=0", "rollout.gpu_memory_fraction=0.0 must be in (0, 1]"),
        ("rollout.weight_sync.timeout_s=0", "rollout.weight_sync.timeout_s=0.0 must be > 0"),
        ("trainer.optimizer.adam_beta1=1", "trainer.optimizer.adam_beta1=1.0 must be in [0, 1)"),
        ("trainer.optimizer.grad_clip=0", "trainer.optimizer.grad_clip=0.0 must be > 0"),
        ("trainer.micro_batch_size=0", "trainer.micro_batch_size=0 must be >= 1"),
        ("model.hidden_size=-64", "model.hidden_size=-64 must be >= 1 (Hidden size)"),
        ("topology.parallel.dp=0", "topology.parallel.dp=0 must be >= 1"),
        ("task.max_response_length=0", "task.max_response_length=0 must be >= 1"),
        ("task.eval.num_samples=0", "task.eval.num_samples=0 must be >= 1"),
        ("precision.activation_tile=0", "precision.activation_tile=0 must be >= 1"),
        ("seed=-3", "seed=-3 must be >= 0"),
    ],
)
def test_a_value_outside_its_fields_range_is_refused_naming_key_range_and_meaning(override, message):
    """Every numeric field declares its range in the schema (`schema.bounded`); one value outside it
    is refused before anything starts, the message naming the full key, the value, the range and what
    the field means. (Before, e.g. num_steps=-1 ran an empty run and exited 0, and temperature=0 failed
    only when the trainer actor was built.)"""
    _refused(_cfg(override), message)


@pytest.mark.parametrize(
    "override",
    ["algorithm.kl_coef=0", "task.eval.interval=0", "checkpoint.save_interval=0", "model.init_sft_steps=0",
     "trainer.optimizer.weight_decay=0", "algorithm.clip_eps_high=5", "rollout.top_p=1", "seed=0"],
)  # fmt: skip
def test_the_ranges_admit_their_documented_edge_values(override):
    """Zero where a field documents it (off / never / no warm-up), and the closed ends of a range."""
    validate(_cfg(override))


def test_range_bounds_and_their_text():
    from skyq.config.schema import Range

    unit = Range(low=0, high=1, low_open=True)
    assert (0 in unit, 1e-9 in unit, 1 in unit, 1.0000001 in unit) == (False, True, True, False)
    assert str(unit) == "in (0, 1]"
    assert str(Range(low=2)) == ">= 2" and str(Range(low=0, low_open=True)) == "> 0"
    assert str(Range(low=0, high=1, high_open=True)) == "in [0, 1)" and str(Range(high=3)) == "<= 3"


def test_every_bounded_default_lies_in_its_range_and_every_recipe_too():
    """The schema's own defaults are valid (`bounded` refuses one that is not, at import), and so are
    the values every model, precision and topology option sets (the recipes compose and validate in
    tests/config/test_compose.py)."""
    import dataclasses

    from skyq.config import schema

    for cls in (c for c in vars(schema).values() if isinstance(c, type) and dataclasses.is_dataclass(c)):
        for f in dataclasses.fields(cls):
            rng = f.metadata.get("range")
            if rng is not None and f.default is not None:
                assert f.default in rng, (cls.__name__, f.name)
    with pytest.raises(ValueError, match="outside its own range"):
        schema.bounded(0, ge=1)


def test_the_models_sizes_must_fit_each_other():
    _refused(_cfg("model.num_experts_per_tok=5"), "model.num_experts_per_tok=5 exceeds model.num_experts=4")
    _refused(_cfg("model.num_key_value_heads=3"), "model.num_attention_heads=4 is not a multiple of")
    _refused(
        _cfg("model.first_k_dense_replace=3"), "model.first_k_dense_replace=3 exceeds model.num_layers=2"
    )
    errors = _refused(_cfg("algorithm.num_steps=0", "rollout.temperature=-1"), "num_steps", "temperature")
    assert errors.count("\n  - ") == 2  # every problem at once


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["algorithm.name=ppo"], "algorithm.name='ppo': skyq implements grpo only"),
        (
            ["trainer.moe_token_dispatcher=alltoal"],
            "trainer.moe_token_dispatcher='alltoal' must be one of alltoall",
        ),
        (["logger.wandb_mode=offlne"], "logger.wandb_mode='offlne' must be one of online, offline, disabled"),
        (["task.dataset=data/train.jsonl"], "task.dataset='data/train.jsonl' with task.name=arith"),
        (["task.eval.dataset=data/eval.jsonl"], "task.eval.dataset='data/eval.jsonl' with task.name=arith"),
        (
            ["task=dapo_math", "task.eval.interval=5"],
            "task.eval.interval=5 with task.name=dapo_math needs task.eval",
        ),
    ],
)
def test_settings_nothing_would_read_are_refused(overrides, message):
    """A string key outside its fixed values, and a dataset the arith task would silently ignore
    (before: each of these ran the default GRPO / generated arithmetic, exit 0)."""
    _refused(_cfg(*overrides), message)


NON_FINITE = {
    "algorithm.lr=nan": "algorithm.lr=nan must be a finite number",
    "algorithm.kl_coef=inf": "algorithm.kl_coef=inf must be a finite number",
    "rollout.weight_sync.timeout_s=nan": "rollout.weight_sync.timeout_s=nan must be a finite number",
    "algorithm.is_cap=inf": "algorithm.is_cap=inf must be a finite number",
    "seed=9223372036854775808": "seed=9223372036854775808 does not fit in 64 bits",
}


def test_nan_inf_and_ints_beyond_int64_are_refused():
    """nan passed every range (`nan <= 0` is False) and inf every open-ended one; a seed past int64 passed
    too. Each failed 30-80 s later inside the workers; now validate names each key (all at once)."""
    errors = _refused(_cfg(*NON_FINITE), *NON_FINITE.values())
    assert errors.count("\n  - ") == len(NON_FINITE)
    _refused(_cfg("algorithm.lr=inf"), "algorithm.lr=inf must be a finite number")


def test_the_largest_int64_seed_is_accepted():
    validate(_cfg("seed=9223372036854775807"))


def test_a_run_refuses_checkpoint_paths_absent_here_a_dry_run_lists_them(tmp_path):
    """A missing checkpoint.hf_checkpoint failed after Ray started; a run (`run_here`) refuses it first."""
    absent = tmp_path / "nowhere"
    cfg = _cfg(f"checkpoint.hf_checkpoint={absent}")
    assert any("does not exist here" in s for s in validate(cfg).skipped)
    with pytest.raises(ConfigValidationError, match=f"checkpoint.hf_checkpoint={absent} does not exist"):
        validate(cfg, run_here=True)
    validate(_cfg(f"checkpoint.hf_checkpoint={_ckpt(tmp_path / 'bf16')}"), run_here=True)


def test_wandb_online_without_an_api_key_is_refused_before_the_run(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_BASE_URL", raising=False)
    netrc = tmp_path / "netrc"
    netrc.write_text("machine example.com login u password p\n")
    monkeypatch.setenv("NETRC", str(netrc))
    cfg = _cfg("logger=wandb", "logger.wandb_mode=online")
    validate(cfg)  # a dry run elsewhere does not need the key
    with pytest.raises(ConfigValidationError, match="logger.wandb_mode=online needs a wandb API key"):
        validate(cfg, run_here=True)
    validate(_cfg("logger=wandb", "logger.wandb_mode=offline"), run_here=True)
    netrc.write_text("machine api.wandb.ai login user password k3y\n")
    netrc.chmod(0o600)
    validate(cfg, run_here=True)
    monkeypatch.setenv("NETRC", str(tmp_path / "absent"))
    monkeypatch.setenv("WANDB_API_KEY", "k3y")
    validate(cfg, run_here=True)


IGNORED_BY_EMBEDDED = [
    "precision.persistent_fp8_params=true",
    "checkpoint.load=/ckpt/iter_100",
    "checkpoint.ref_load=/ckpt/ref",
    "trainer.recompute.granularity=full",
    "trainer.recompute.num_layers=2",
    "trainer.optimizer.cpu_offload=true",
    "trainer.optimizer.overlap_cpu_offload=true",
    "trainer.optimizer.precision_aware=true",
    "trainer.deepep_max_dispatch_tokens=128",
    "trainer.moe_token_dispatcher=flex",
    "topology.parallel.ep=2",
    "rollout.gpu_memory_fraction=0.5",
]


def test_settings_the_embedded_backends_ignore_are_refused_naming_who_reads_them():
    """Each was accepted on trainer=torch rollout=embedded and changed nothing; the backend table
    (skyq.config.backends) names the backend that reads it."""
    cfg = _cfg("precision=fp8_blockwise", *IGNORED_BY_EMBEDDED)
    with pytest.raises(ConfigValidationError) as info:
        validate(cfg)
    for override in IGNORED_BY_EMBEDDED:
        (line,) = [e for e in info.value.errors if e.startswith(f"{override} is read only by ")]
        assert "would ignore it" in line and f"Fix: {override.split('=')[0]}=" in line, line
        assert "trainer=megatron" in line or "rollout=vllm" in line, line
    assert "Fix: trainer.recompute.granularity=none (its default)" in str(info.value)


def test_settings_are_accepted_on_the_backend_that_reads_them():
    validate(
        _cfg(
            *AT_SCALE, "trainer.recompute.granularity=full", "trainer.optimizer.cpu_offload=true",
            "trainer.optimizer.precision_aware=true",
        )
    )  # fmt: skip
    _refused(
        _cfg(*AT_SCALE, "rollout.cuda_graphs=false"),
        "rollout.cuda_graphs=false is read only by rollout=embedded",
    )


def test_an_offloaded_megatron_optimizer_needs_the_precision_aware_path():
    """megatron-core's HybridDeviceOptimizer reuses the precision-aware path: without it 0.19.2 cannot
    load its checkpoint back (measured on the H200); with FP8 parameters it needs delayed scaling."""
    _refused(
        _cfg(*AT_SCALE, "trainer.optimizer.cpu_offload=true"), "Fix: trainer.optimizer.precision_aware=true."
    )
    _refused(
        _cfg(
            *AT_SCALE, "trainer.optimizer.cpu_offload=true", "trainer.optimizer.precision_aware=true",
            "precision=fp8_blockwise", "precision.persistent_fp8_params=true",
        ),
        "with precision.persistent_fp8_params=true",
    )  # fmt: skip


def test_the_native_pair_refuses_a_model_it_cannot_build():
    """DeepSeek-V3 models build, Kimi-K2.6's vision tower too (model=tiny_deepseek and tiny_kimi_vl
    validate); MTP layers, a tower on another family or of a width its 72-wide heads do not divide do not."""
    validate(_cfg("model=tiny_deepseek"))
    validate(_cfg("model=tiny_kimi_vl"))
    _refused(_cfg("model=tiny_kimi_vl", "model.vision_hidden_size=100"), "use a multiple of 72")
    _refused(_cfg("model=tiny_moe", "model.vision_num_layers=1", "model.vision_hidden_size=72",
                  "model.vision_intermediate_size=144"), "a vision tower is Kimi-K2.6's")  # fmt: skip
    _refused(
        _cfg("model=tiny_deepseek", "model.num_nextn_predict_layers=1"), "no multi-token-prediction layers"
    )


def test_the_trap_a_30b_model_on_the_embedded_pair_is_refused_with_its_numbers():
    """model=qwen3_30b topology=8gpu trainer=torch validated and dry-ran as DP8/EP8 with 8 engines while the
    embedded pair puts the whole model on one trainer GPU and one engine GPU."""
    from skyq import preflight

    _refused(
        _cfg("model=qwen3_30b", "topology=8gpu"), "topology.parallel.ep=8 is read only by trainer=megatron"
    )
    cfg = _cfg("model=qwen3_30b", "topology=8gpu", "topology.parallel.ep=1")
    validate(cfg)
    with pytest.raises(ConfigValidationError) as info:
        preflight.check(cfg)
    msg = str(info.value)
    assert "model=qwen3_30b has 30.5B parameters" in msg and "550 GB" in msg and "31 GB" in msg
    assert "trainer=megatron rollout=vllm" in msg
    preflight.check(_cfg("model=small_moe", "topology=2gpu"))
    preflight.check(_cfg(*AT_SCALE))  # the at-scale backends shard it


def _hf_config(path, **fields):
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", **fields}))
    return str(path)


def test_a_checkpoint_of_another_model_is_refused(tmp_path):
    """A 2-layer hidden-128 checkpoint was accepted for model=qwen3_30b."""
    small = _hf_config(tmp_path / "small", num_hidden_layers=2, hidden_size=128, num_experts=4,
                       moe_intermediate_size=64)  # fmt: skip
    msg = _refused(
        _cfg("model=qwen3_30b", f"checkpoint.hf_checkpoint={small}"), "is another model than model=qwen3_30b"
    )
    assert (
        "num_hidden_layers=2 vs model.num_layers=48" in msg
        and "hidden_size=128 vs model.hidden_size=2048" in msg
    )
    assert "num_experts=4 vs model.num_experts=128" in msg and "moe_intermediate_size=64 vs" in msg
    same = _hf_config(tmp_path / "same", num_hidden_layers=48, hidden_size=2048, num_experts=128,
                      moe_intermediate_size=768)  # fmt: skip
    validate(_cfg("model=qwen3_30b", f"checkpoint.hf_checkpoint={same}"))
    kimi = tmp_path / "kimi"
    kimi.mkdir()
    (kimi / "config.json").write_text(
        json.dumps({"text_config": {"num_hidden_layers": 61, "n_routed_experts": 64}})
    )
    _refused(_cfg("recipe=kimi_k26_int4_qat_256gpu_text", f"checkpoint.hf_checkpoint={kimi}"),
             "n_routed_experts=64 vs model.num_experts=384")  # fmt: skip


def _fp8_block(skip, scale_fmt=None):
    block = {"quant_method": "fp8", "weight_block_size": [128, 128], "modules_to_not_convert": skip}
    if scale_fmt:
        block["scale_fmt"] = scale_fmt
    return block


ATTN_KEPT = ["lm_head", "model.layers.0.mlp.gate", "model.layers.0.self_attn.q_proj"]
"""A skip list of an expert-only checkpoint (attention kept bf16)."""


def test_fp8_checkpoint_scale_format_must_match(tmp_path):
    ue8m0 = _ckpt(tmp_path / "ue8m0", _fp8_block(["lm_head"], "ue8m0"))
    fp32 = _ckpt(tmp_path / "fp32", _fp8_block(["lm_head"]))
    fp8 = [*AT_SCALE, "precision=fp8_blockwise"]
    _refused(_cfg(*fp8, f"checkpoint.rollout_checkpoint={ue8m0}"),
             "has scale_fmt=ue8m0 (power-of-two scales) but precision.scale_format=fp32")  # fmt: skip
    _refused(_cfg(*fp8, "precision.scale_format=ue8m0", f"checkpoint.rollout_checkpoint={fp32}"),
             "has fp32 scales but precision.scale_format=ue8m0", "--scale-fmt ue8m0")  # fmt: skip
    validate(_cfg(*fp8, "precision.scale_format=ue8m0", f"checkpoint.rollout_checkpoint={ue8m0}"))


def test_fp8_and_mxfp8_checkpoint_scope_must_match_the_runs(tmp_path):
    """An all-linear checkpoint under an expert-only run (and the reverse) was accepted."""
    fp8_all = _ckpt(tmp_path / "fp8_all", _fp8_block(["lm_head", "model.layers.0.mlp.gate"]))
    fp8_experts = _ckpt(tmp_path / "fp8_experts", _fp8_block(ATTN_KEPT))
    fp8 = [*AT_SCALE, "precision=fp8_blockwise"]
    _refused(_cfg(*fp8, "precision.fp8_targets=routed_experts", f"checkpoint.rollout_checkpoint={fp8_all}"),
             "quantizes attention and experts (all_linear) but precision.fp8_targets=routed_experts")  # fmt: skip
    _refused(_cfg(*fp8, f"checkpoint.rollout_checkpoint={fp8_experts}"),
             "quantizes routed experts only (routed_experts) but precision.fp8_targets=all_linear")  # fmt: skip
    validate(_cfg(*fp8, f"checkpoint.rollout_checkpoint={fp8_all}"))

    def mx(ignore):
        return {"quant_method": "compressed-tensors", "format": "mxfp8-quantized", "ignore": ignore}

    mx_all = _ckpt(tmp_path / "mx_all", mx(["lm_head", "re:^model\\.layers\\.\\d+\\.mlp\\.gate$"]))
    mx_experts = _ckpt(
        tmp_path / "mx_experts", mx(["lm_head", "re:^model\\.layers\\.\\d+\\.self_attn\\.q_proj$"])
    )
    mxfp8 = [*AT_SCALE, "precision=mxfp8"]
    _refused(_cfg(*mxfp8, f"checkpoint.rollout_checkpoint={mx_all}"),
             "(all_linear) but precision.mxfp8_targets=routed_experts")  # fmt: skip
    _refused(_cfg(*mxfp8, "precision.mxfp8_targets=all_linear", f"checkpoint.rollout_checkpoint={mx_experts}"),
             "(routed_experts) but precision.mxfp8_targets=all_linear")  # fmt: skip
    validate(_cfg(*mxfp8, f"checkpoint.rollout_checkpoint={mx_experts}"))
