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
    validate(_cfg("precision=bf16", "rollout.weight_sync.mode=delta"))


def test_mxfp8_with_persistent_fp8_params_is_refused():
    _refused(
        _cfg("precision=mxfp8", "precision.persistent_fp8_params=true"),
        "precision.persistent_fp8_params=true",
    )


def test_parallel_product_must_equal_trainer_gpus():
    _refused(
        _cfg("model=qwen3_30b", "topology=8gpu", "topology.parallel.tp=2", "topology.parallel.dp=2"),
        "tp*pp*cp*dp = 2*1*1*2 = 4",
        "topology.trainer_gpus=8",
    )
    _refused(_cfg("model=qwen3_30b", "topology=8gpu", "topology.parallel.tp=3"), "not divisible by tp*pp*cp")


def test_ep_must_divide_experts():
    _refused(
        _cfg("model=qwen3_30b", "topology=8gpu", "topology.parallel.ep=3"),
        "topology.parallel.ep=3 does not divide model.num_experts=128",
    )


def test_engines_times_gpus_per_engine_must_equal_rollout_gpus():
    _refused(
        _cfg("model=qwen3_30b", "topology=8gpu", "rollout.gpus_per_engine=3"),
        "topology.rollout_gpus=8",
        "rollout.gpus_per_engine=3",
    )


def test_colocated_needs_the_same_gpus():
    _refused(
        _cfg("model=qwen3_30b", "topology=8gpu", "topology.rollout_gpus=4"), "topology.placement=colocated"
    )


def test_split_placement_must_add_up():
    validate(
        _cfg(
            "model=qwen3_30b",
            "topology=8gpu",
            "topology.placement=split",
            "topology.trainer_gpus=4",
            "topology.rollout_gpus=4",
            "topology.parallel.ep=4",
        )
    )
    _refused(
        _cfg(
            "model=qwen3_30b",
            "topology=8gpu",
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
            "model=qwen3_30b",
            "topology=8gpu",
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


def test_gpu_backends_refused_on_cpu_topology():
    _refused(_cfg("rollout=vllm"), "rollout.backend=vllm", "topology.device=cpu")


def test_all_errors_are_reported_at_once():
    with pytest.raises(ConfigValidationError) as info:
        validate(
            _cfg("precision=mxfp8", "precision.persistent_fp8_params=true", "rollout.weight_sync.mode=delta")
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
    cfg_ok = _cfg("precision=int4_qat", f"checkpoint.rollout_checkpoint={ok}")
    validate(cfg_ok)
    assert (
        preflight.plan_errors(model=cfg_ok.model, precision=cfg_ok.precision, checkpoint=cfg_ok.checkpoint)
        == []
    )
    bad = _int4_block(group_size=32)
    bad["ignore"] = ["lm_head"]  # attention and router left quantized
    path = _ckpt(tmp_path / "bad", bad)
    cfg_bad = _cfg("precision=int4_qat", f"checkpoint.rollout_checkpoint={path}")
    with pytest.raises(ConfigValidationError, match="precision.qat_scope=routed_experts"):
        preflight.check(model=cfg_bad.model, precision=cfg_bad.precision, checkpoint=cfg_bad.checkpoint)


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
