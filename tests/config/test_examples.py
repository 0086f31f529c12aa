"""Recipes as contributions: the rule every file of recipes/ follows (docs/recipes.md), launch scripts
checked where they exist, one new YAML file being a complete contribution, `recipe=<path to a .yaml>`."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from skyq.config.store import CONF_DIR, RECIPES_DIR, RecipeError, compose, recipe_problems, to_object
from skyq.config.validate import validate

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "train" / "fp8"
NEW_RECIPE = """\
# @package _global_
# Tiny Qwen3-MoE, GRPO on arith in BF16: the embedded run without quantization, CPU only.
# Launch: python -m skyq.train recipe=tiny_moe_bf16_cpu_short
defaults:
  - override /precision: bf16
  - override /model: tiny_moe
  - override /topology: cpu
  - override /task: arith

algorithm:
  num_steps: 7
"""


def launch_script_problems(recipes_dir: Path, examples_dir: Path) -> list[str]:
    """Each launch script that exists runs a recipe of `recipes_dir` (the one its name says) and has a
    row in its folder's README; a recipe needs no script."""
    readme = (examples_dir / "README.md").read_text()
    problems = []
    for script in sorted(examples_dir.glob("run_*.sh")):
        name = script.stem.removeprefix("run_")
        if not (recipes_dir / f"{name}.yaml").is_file():
            problems.append(f"{script.name}: no recipe {name}.yaml in {recipes_dir}")
        if not re.search(rf"\brecipe={re.escape(name)}\s", script.read_text()):
            problems.append(f"{script.name}: does not run recipe={name}")
        if f"`{script.name}`" not in readme:
            problems.append(f"{script.name}: no row in {examples_dir / 'README.md'}")
    return problems


def test_conf_recipe_is_the_recipes_directory_not_a_copy():
    assert (CONF_DIR / "recipe").is_symlink()
    assert (CONF_DIR / "recipe").resolve() == RECIPES_DIR.resolve()


def test_every_recipe_follows_the_recipe_rule():
    assert len(list(RECIPES_DIR.glob("*.yaml"))) >= 5
    assert [p for path in sorted(RECIPES_DIR.glob("*.yaml")) for p in recipe_problems(path)] == []


def test_every_launch_script_runs_an_existing_recipe_and_has_a_readme_row():
    assert launch_script_problems(RECIPES_DIR, EXAMPLES) == []


def test_one_new_yaml_is_a_complete_contribution(tmp_path):
    """recipes/ plus one new file, nothing else added: every check CI runs over recipes/ passes, and
    the recipe composes by path to what it says."""
    recipes = tmp_path / "recipes"
    shutil.copytree(RECIPES_DIR, recipes)
    new = recipes / "tiny_moe_bf16_cpu_short.yaml"
    new.write_text(NEW_RECIPE)
    assert recipe_problems(new) == []
    assert launch_script_problems(recipes, EXAMPLES) == []
    cfg = to_object(compose([f"recipe={new}"]))
    assert (cfg.precision.name.value, cfg.model.name, cfg.algorithm.num_steps) == ("bf16", "tiny_moe", 7)
    validate(cfg)


def test_recipe_rule_names_the_file_and_the_fix(tmp_path):
    bad = tmp_path / "bf16_tiny.yaml"
    bad.write_text("defaults:\n  - override /precision: bf16\nrollout:\n  _target_: x\n")
    problems = "\n".join(recipe_problems(bad))
    for expected in (
        "bf16_tiny.yaml: name it <model>_<precision>_<cpu|Ngpu>[_<variant>]",
        "line 1 must be `# @package _global_`",
        "line 2 must be a `# <one-line description>` comment",
        "`# Launch: python -m skyq.train recipe=bf16_tiny`",
        "no `_target_` in a recipe",
    ):
        assert expected in problems
    liar = tmp_path / "tiny_moe_mxfp8_cpu.yaml"  # says mxfp8, composes bf16
    liar.write_text(NEW_RECIPE.replace("recipe=tiny_moe_bf16_cpu_short", "recipe=tiny_moe_mxfp8_cpu"))
    assert recipe_problems(liar) == [
        "tiny_moe_mxfp8_cpu.yaml: the name says precision=mxfp8 but the recipe composes precision=bf16"
    ]


def test_a_recipe_file_beats_a_recipe_of_the_same_name(tmp_path):
    """An edited copy keeps its original's name (`python -m skyq.config cp`): the path picks the copy."""
    name = "qwen3_30b_int4_qat_8gpu"
    copy = tmp_path / f"{name}.yaml"
    copy.write_text((RECIPES_DIR / f"{name}.yaml").read_text().replace("lr: 1.0e-06", "lr: 3.0e-06"))
    assert to_object(compose([f"recipe={copy}"])).algorithm.lr == 3e-06
    assert to_object(compose([f"recipe={name}"])).algorithm.lr == 1e-06
    assert to_object(compose([f"recipe={RECIPES_DIR / f'{name}.yaml'}"])).algorithm.lr == 1e-06


def test_a_bad_recipe_file_is_refused_by_name(tmp_path):
    with pytest.raises(RecipeError, match=r"recipe=.*absent\.yaml: no such file"):
        compose([f"recipe={tmp_path / 'absent.yaml'}"])
    headless = tmp_path / "headless.yaml"
    headless.write_text("algorithm:\n  num_steps: 3\n")
    with pytest.raises(
        RecipeError, match="headless.yaml: a recipe's first line must be `# @package _global_`"
    ):
        compose([f"recipe={headless}"])


def test_skyq_train_takes_a_recipe_file(tmp_path):
    """`python -m skyq.train recipe=<path>` as a user types it: a dry run of the file's config, and a
    missing file as one `error:` line, exit 2."""
    recipe = tmp_path / "my_experiment.yaml"
    recipe.write_text(NEW_RECIPE.replace("num_steps: 7", "num_steps: 9"))
    train = [sys.executable, "-m", "skyq.train", f"output_root={tmp_path / 'runs'}"]
    out = subprocess.run(
        [*train, f"recipe={recipe}", "dry_run=true"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "precision=bf16" in out.stdout.splitlines()[0]  # the file's choice, not the default fp8_blockwise
    missing = subprocess.run(
        [*train, f"recipe={tmp_path / 'nope.yaml'}"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    assert missing.returncode == 2
    assert missing.stderr.strip().splitlines() == [
        f"error: recipe={tmp_path / 'nope.yaml'}: no such file ({tmp_path / 'nope.yaml'}). Fix: recipe=<path "
        "to a recipe .yaml>, or recipe=<name> of a file in recipes/ (`python -m skyq.config ls` lists them)"
    ]


def test_a_gpu_launch_script_dry_runs_with_its_env(tmp_path):
    env = {
        **os.environ,
        "DRY_RUN": "1",
        "ROLLOUT_CKPT": str(tmp_path / "absent"),
        "PY": str(Path(sys.executable)),
    }
    out = subprocess.run(
        [str(EXAMPLES / "run_qwen3_30b_int4_qat_8gpu.sh"), f"output_root={tmp_path}"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"checkpoint.rollout_checkpoint={tmp_path / 'absent'} does not exist here" in out.stdout
