"""Real Hydra composition of every group option, recipe and typo."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from skyq.config.enums import Precision
from skyq.config.store import CONF_DIR, ConfigKeyError, compose, to_object
from skyq.config.validate import ConfigValidationError, validate

RECIPES = sorted((CONF_DIR.parent / "recipes").rglob("*.yaml"))

# Each topology on the backends it is for: the embedded pair (trainer=torch rollout=embedded) on cpu and
# 1gpu, the at-scale pair (trainer=megatron rollout=vllm) on 8gpu and 256gpu, whose topology.parallel
# layout only Megatron reads.
BACKENDS = {
    "cpu": ["trainer=torch", "rollout=embedded"],
    "1gpu": ["trainer=torch", "rollout=embedded"],
    "8gpu": ["trainer=megatron", "rollout=vllm"],
    "256gpu": ["trainer=megatron", "rollout=vllm"],
}

# Combinations that must be refused, with the reason each is refused (from the architectures:
# tiny_moe has 4 experts, so EP 8/32 cannot divide it; Kimi's 61 layers do not split over 8 stages
# without the recipe's uneven first/last stages).
EXPECTED_REFUSALS = {
    ("tiny_moe", "8gpu"): "topology.parallel.ep=8 does not divide model.num_experts=4",
    ("tiny_moe", "256gpu"): "topology.parallel.ep=32 does not divide model.num_experts=4",
    ("kimi_k26", "256gpu"): "model.num_layers=61",
    ("tiny_deepseek", "8gpu"): "topology.parallel.ep=8 does not divide model.num_experts=4",
    ("tiny_deepseek", "256gpu"): "topology.parallel.ep=32 does not divide model.num_experts=4",
}


@pytest.mark.parametrize(
    "precision,model,topology",
    list(
        itertools.product(
            ["bf16", "fp8_blockwise", "mxfp8", "int4_qat"],
            ["tiny_moe", "tiny_deepseek", "qwen3_30b", "kimi_k26"],
            ["cpu", "1gpu", "8gpu", "256gpu"],
        )
    ),
)
def test_every_combination_composes_and_validates_or_fails_for_its_reason(precision, model, topology):
    cfg = to_object(
        compose([f"precision={precision}", f"model={model}", f"topology={topology}", *BACKENDS[topology]])
    )
    assert cfg.precision.name is Precision(precision)
    assert cfg.model.name == model and cfg.topology.name == topology
    reason = EXPECTED_REFUSALS.get((model, topology))
    if reason is None:
        validate(cfg)
    else:
        with pytest.raises(ConfigValidationError, match=reason.replace(".", r"\.").replace("(", r"\(")):
            validate(cfg)


def test_default_config_is_the_embedded_run():
    cfg = to_object(compose([]))
    assert (cfg.model.name, cfg.precision.name.value, cfg.topology.name) == (
        "tiny_moe",
        "fp8_blockwise",
        "cpu",
    )
    assert (cfg.trainer.backend.value, cfg.rollout.backend.value, cfg.task.name.value) == (
        "torch",
        "embedded",
        "arith",
    )
    validate(cfg)


@pytest.mark.parametrize("path", RECIPES, ids=[p.stem for p in RECIPES])
def test_every_recipe_composes_and_validates(path):
    cfg = to_object(compose([f"recipe={path.stem}"]))
    if path.stem == "kimi_k26_int4_qat_256gpu_multimodal":
        # the seed's multimodal pair (Megatron + vLLM): neither serves a vision tower yet (only
        # trainer=torch + rollout=embedded do), so its images would be dropped: refused, naming who reads them
        with pytest.raises(
            ConfigValidationError, match="task.image_key=.* is read only by trainer=torch / rollout=embedded"
        ):
            validate(cfg)
        return
    report = validate(cfg)
    if cfg.topology.device.value == "cuda" and cfg.checkpoint.hf_checkpoint is not None:
        # the checkpoint paths are the user's; here they do not exist, and the report says so
        assert any("does not exist here" in s for s in report.skipped)


def test_kimi_recipes_hold_the_256_gpu_layout():
    for variant in ("text", "multimodal"):
        cfg = to_object(compose([f"recipe=kimi_k26_int4_qat_256gpu_{variant}"]))
        p = cfg.topology.parallel
        assert (p.tp, p.pp, p.cp, p.ep, p.etp) == (8, 8, 4, 32, 1)
        assert cfg.topology.rollout_gpus // cfg.rollout.gpus_per_engine == 16
        assert (cfg.rollout.gpus_per_engine, cfg.rollout.dp_size, cfg.rollout.ep_size) == (16, 16, 16)
        assert cfg.precision.int4_group_size == 32 and cfg.algorithm.group_size == 32
        assert cfg.checkpoint.rollout_checkpoint != cfg.checkpoint.ref_load
        assert cfg.trainer.deepep_max_dispatch_tokens == 256
        assert cfg.trainer.optimizer.cpu_offload and cfg.trainer.optimizer.precision_aware
    text = to_object(compose(["recipe=kimi_k26_int4_qat_256gpu_text"]))
    assert (text.task.max_response_length, text.algorithm.global_batch_size, text.algorithm.lr) == (
        16384,
        256,
        1e-6,
    )
    assert (text.task.eval.dataset, text.task.eval.interval) == ("aime-2024", 20)
    mm = to_object(compose(["recipe=kimi_k26_int4_qat_256gpu_multimodal"]))
    assert (mm.task.max_prompt_length, mm.task.max_response_length, mm.task.max_image_tokens) == (
        2048,
        4096,
        256,
    )
    assert (mm.algorithm.global_batch_size, mm.algorithm.lr, mm.task.image_key) == (512, 5e-6, "images")


@pytest.mark.parametrize(
    "override,key",
    [
        ("precision.nme=1", "precision.nme"),
        ("+precision.nme=1", "precision.nme"),
        ("+topology.parallel.tpp=2", "topology.parallel.tpp"),
        ("+foo=1", "foo"),
        ("model.hidden_size=abc", "model.hidden_size"),
        ("precision.name=fp9", "precision.name"),
        ("precision.int4_grid=KIMI2", "precision.int4_grid"),
    ],
)
def test_typos_and_wrong_types_fail_at_compose_time_with_the_key_path(override, key):
    with pytest.raises(Exception) as info:
        compose([override])
    text = str(info.value) + str(info.value.__cause__ or "")
    assert key in text, text


def test_plus_cannot_smuggle_unknown_fields_but_dict_fields_accept_new_entries():
    with pytest.raises(ConfigKeyError, match="rollout.weight_sync.bucket_size"):
        compose(["+rollout.weight_sync.bucket_size=5"])
    cfg = to_object(compose(["+rollout.env.MY_FLAG=1"]))
    assert cfg.rollout.env == {"MY_FLAG": "1"}


def test_config_key_set_snapshot():
    """Adding or removing a key is a deliberate change: update tests/config/key_snapshot.json too."""
    from omegaconf import OmegaConf

    def keys(node, prefix=""):
        out = []
        for k, v in node.items():
            if isinstance(v, dict) and k not in ("env",):
                out += keys(v, f"{prefix}{k}.")
            else:
                out.append(f"{prefix}{k}")
        return out

    container = OmegaConf.to_container(compose([]), enum_to_str=True)
    snapshot = json.loads((Path(__file__).parent / "key_snapshot.json").read_text())
    assert sorted(keys(container)) == snapshot


def test_run_directories_are_unique_even_in_the_same_second():
    """The run dir interpolates a random suffix; composing twice gives two different directories."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    from skyq.config.store import register

    register()
    dirs = set()
    for _ in range(2):
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = hydra_compose(config_name="train", return_hydra_config=True)
            HydraConfig.instance().set_config(cfg)
            dirs.add(OmegaConf.to_container(cfg.hydra.run, resolve=True)["dir"])
    assert len(dirs) == 2


def test_multirun_composes_independent_jobs(tmp_path):
    import subprocess
    import sys

    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "skyq.train",
            "-m",
            "precision=bf16,int4_qat",
            "dry_run=true",
            f"output_root={tmp_path}",
        ],
        capture_output=True,
        text=True,
        cwd=CONF_DIR.parent,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert "precision bf16" in out.stdout and "precision int4_qat" in out.stdout
    assert out.stdout.count("config valid; dry run only") == 2
