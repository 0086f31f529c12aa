"""Register the schema with Hydra's ConfigStore and compose configurations.

Every group option in conf/ starts from a `base_<group>` node registered here, so unknown keys and
wrong types fail at compose time with the full key path. Recipes: `recipe=<name>` picks a file of
recipes/ (conf/recipe is a symlink to it, so Hydra sees one copy as the `recipe` group);
`recipe=<path to a .yaml>` composes a recipe file from anywhere (`recipe_file_overrides`), and
`recipe_problems` is the rule a file of recipes/ follows (docs/recipes.md).
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import re
import shutil
import sys
import tempfile
import uuid
from collections.abc import Sequence
from pathlib import Path

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from skyq.config import schema

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"
"""The `conf/` directory of the source tree (skyq is installed editable)."""
RECIPES_DIR = CONF_DIR.parent / "recipes"
"""The recipes, one YAML file each; `conf/recipe` is a symlink to this directory, not a copy."""

GROUPS: dict[str, type] = {
    "precision": schema.PrecisionConfig,
    "model": schema.ModelConfig,
    "topology": schema.TopologyConfig,
    "algorithm": schema.AlgorithmConfig,
    "task": schema.TaskConfig,
    "rollout": schema.RolloutConfig,
    "trainer": schema.TrainerConfig,
    "logger": schema.LoggerConfig,
}


def register() -> None:
    """Register `base_train`, one `base_<group>` schema node per group and skyq's resolvers (idempotent)."""
    if not OmegaConf.has_resolver("skyq_uid"):
        # A random run-directory suffix, resolved once per config (two runs in one second differ).
        OmegaConf.register_new_resolver("skyq_uid", lambda: uuid.uuid4().hex[:8], use_cache=True)
    if not OmegaConf.has_resolver("skyq_output_root"):
        OmegaConf.register_new_resolver("skyq_output_root", writable_output_root)
    cs = ConfigStore.instance()
    cs.store(name="base_train", node=schema.TrainConfig)
    for group, node in GROUPS.items():
        cs.store(group=group, name=f"base_{group}", node=node)


def writable_output_root(root: str) -> str:
    """`output_root` itself, once a run directory can be made in it (created if missing). Only the
    command line resolves it (the `hydra.run.dir` / `hydra.sweep.dir` of conf/train.yaml, before Hydra
    makes the run directory), so a bad root ends the command as every config error does: `error: ...`
    naming the key, the path and the OS's reason on stderr, exit 2 (an exception raised here would reach
    the user as Hydra's traceback of its interpolation)."""
    path = Path(root).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
        os.rmdir(tempfile.mkdtemp(prefix=".skyq-probe-", dir=path))  # what a run directory needs
    except OSError as exc:
        print(
            f"error: output_root={root!r}: cannot make a run directory there ({exc.strerror}). "
            "Fix: output_root=<a writable directory>",
            file=sys.stderr,
        )
        raise SystemExit(2) from None
    return root


def compose(overrides: list[str] | tuple[str, ...] = ()) -> DictConfig:
    """Compose conf/train.yaml with command-line style overrides (as `python -m skyq.train` does)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    register()
    with (
        tempfile.TemporaryDirectory(prefix="skyq-recipe-") as staging,
        initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"),
    ):
        cfg = hydra_compose(config_name="train", overrides=recipe_file_overrides(overrides, Path(staging)))
    return strict(cfg)


class RecipeError(ValueError):
    """A recipe file that cannot be composed, or a file of recipes/ that breaks the recipe rule."""


RECIPE_HEADER = "# @package _global_"
"""A recipe's first line: its keys are top-level config keys, not keys under `recipe`."""
RECIPE_FILE_SUFFIXES = (".yaml", ".yml")
FILE_RECIPES = "file"
"""The sub-group a recipe file from outside recipes/ is staged in: `recipe=file/<stem>` never picks a
file of recipes/ of the same name (a user's edited copy of one keeps its name)."""


def recipe_file_overrides(overrides: Sequence[str], staging: Path) -> list[str]:
    """`overrides` with each `recipe=<path to a .yaml>` (or a comma-separated sweep of them) made a
    group option Hydra can compose: the file is copied to `staging/recipe/file/<stem>.yaml`, the
    override becomes `recipe=file/<stem>` and `hydra.searchpath` gains `staging`. A file inside
    recipes/ becomes `recipe=<stem>`. Other overrides pass unchanged.

    Raises RecipeError for a file that does not exist or lacks the `# @package _global_` line.
    """
    out, staged = [], False
    for override in overrides:
        key, sep, value = override.partition("=")
        items = value.split(",")
        if key != "recipe" or not sep or not any(v.endswith(RECIPE_FILE_SUFFIXES) for v in items):
            out.append(override)
            continue
        names = [_stage_recipe(v, staging) if v.endswith(RECIPE_FILE_SUFFIXES) else v for v in items]
        staged = staged or any(n.startswith(f"{FILE_RECIPES}/") for n in names)
        out.append("recipe=" + ",".join(names))
    if staged:
        if any(o.lstrip("+~").startswith("hydra.searchpath=") for o in overrides):
            raise RecipeError(
                "recipe=<file> adds its own hydra.searchpath entry. Fix: drop hydra.searchpath, or put the "
                "recipe in a recipe/ folder of your search path and pick it by name"
            )
        out.append(f"hydra.searchpath=[file://{staging}]")
    return out


def _stage_recipe(value: str, staging: Path) -> str:
    path = Path(value).expanduser().resolve()
    if not path.is_file():
        raise RecipeError(
            f"recipe={value}: no such file ({path}). Fix: recipe=<path to a recipe .yaml>, or "
            "recipe=<name> of a file in recipes/ (`python -m skyq.config ls` lists them)"
        )
    if path.parent == RECIPES_DIR.resolve():
        return path.stem
    if not re.fullmatch(r"[A-Za-z0-9_-]+", path.stem):
        raise RecipeError(
            f"recipe={value}: name the file with letters, digits, _ and - only (Hydra parses it)"
        )
    text = path.read_text(encoding="utf-8")
    if text.splitlines()[:1] != [RECIPE_HEADER]:
        raise RecipeError(
            f"{path}: a recipe's first line must be `{RECIPE_HEADER}` (its keys are top-level config keys). "
            "Fix: add that line at the top"
        )
    dest = staging / "recipe" / FILE_RECIPES / f"{path.stem}.yaml"
    if dest.exists() and dest.read_text(encoding="utf-8") != text:
        raise RecipeError(f"recipe={value}: two different recipe files named {path.stem}.yaml; rename one")
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(text, encoding="utf-8")
    return f"{FILE_RECIPES}/{path.stem}"


def recipe_file_argv(argv: Sequence[str]) -> list[str]:
    """`python -m skyq.train`'s arguments with any `recipe=<path to a .yaml>` made composable
    (`recipe_file_overrides`), staged in a directory that lives until the process exits (a sweep
    composes each job from it). A bad recipe file ends the command as every config error does: one
    `error:` line on stderr, exit 2."""
    if not any(a.startswith("recipe=") and a.endswith(RECIPE_FILE_SUFFIXES) for a in argv):
        return list(argv)
    staging = Path(tempfile.mkdtemp(prefix="skyq-recipe-"))
    atexit.register(shutil.rmtree, staging, ignore_errors=True)
    try:
        return recipe_file_overrides(argv, staging)
    except RecipeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def recipe_name_pattern() -> re.Pattern[str]:
    """`<model>_<precision>_<topology>[_<variant>]`: a model and a precision option of conf/, a
    topology `cpu` or `<N>gpu`, and an optional lower-case variant (`_text`, `_multimodal`)."""

    def options(group: str) -> str:
        names = sorted((p.stem for p in (CONF_DIR / group).glob("*.yaml")), key=len, reverse=True)
        return "|".join(map(re.escape, names))

    return re.compile(
        rf"(?P<model>{options('model')})_(?P<precision>{options('precision')})_(?P<topology>cpu|\d+gpu)"
        r"(?:_(?P<variant>[a-z0-9]+(?:_[a-z0-9]+)*))?"
    )


def recipe_problems(path: Path) -> list[str]:
    """Why `path` is not a well-formed recipe of recipes/ (empty when it is one); each line names the
    file, the rule and the fix. The rule (docs/recipes.md): the name says the model, precision and
    topology the recipe composes to; line 1 is `# @package _global_`; line 2 a one-line description
    (`python -m skyq.config ls` prints it); a `# Launch: python -m skyq.train recipe=<name>` comment;
    choices as `override /<group>: <option>`, never `_target_` or `oc.env`; it composes."""
    name, lines = path.stem, path.read_text(encoding="utf-8").splitlines()
    problems = []
    match = recipe_name_pattern().fullmatch(name)
    if match is None:
        problems.append(
            f"{path.name}: name it <model>_<precision>_<cpu|Ngpu>[_<variant>] with a model and a precision "
            f"option of conf/ (e.g. tiny_moe_fp8_blockwise_cpu)"
        )
    if lines[:1] != [RECIPE_HEADER]:
        problems.append(f"{path.name}: line 1 must be `{RECIPE_HEADER}`")
    if len(lines) < 2 or not re.fullmatch(r"# \S.*", lines[1]) or lines[1].startswith("# Launch:"):
        problems.append(f"{path.name}: line 2 must be a `# <one-line description>` comment")
    launch = re.compile(rf"# Launch: python -m skyq\.train recipe={re.escape(name)}(\s|$)")
    if not any(launch.match(line) for line in lines):
        problems.append(f"{path.name}: add the comment `# Launch: python -m skyq.train recipe={name}`")
    for banned in ("_target_", "oc.env"):
        if any(banned in line for line in lines):
            problems.append(f"{path.name}: no `{banned}` in a recipe (choices and values only)")
    if match is None or problems:
        return problems
    try:
        cfg = to_object(compose([f"recipe={path}"]))
    except Exception as exc:  # any composition failure is this recipe's problem, reported by name
        return [f"{path.name}: does not compose: {exc}"]
    composed = {"model": cfg.model.name, "precision": cfg.precision.name.value, "topology": cfg.topology.name}
    return [
        f"{path.name}: the name says {part}={match[part]} but the recipe composes {part}={value}"
        for part, value in composed.items()
        if match[part] != value
    ]


class ConfigKeyError(ValueError):
    """A key that is not in the schema, or a value of the wrong type."""


def strict(cfg: DictConfig) -> DictConfig:
    """Check a composed config against the schema, including keys added with `+key=`.

    Hydra appends `+key=value` overrides with the struct flag lifted, so the composed tree can hold
    keys the dataclasses do not declare; each one is refused here with its full key path. Values are
    re-validated by merging onto a fresh structured TrainConfig (types, enums).
    """
    from omegaconf.errors import OmegaConfBaseException

    _refuse_unknown_keys(cfg, schema.TrainConfig, "")
    try:
        merged = OmegaConf.merge(OmegaConf.structured(schema.TrainConfig), cfg)
    except OmegaConfBaseException as exc:
        raise ConfigKeyError(f"config key `{exc.full_key}`: {exc.msg}") from None
    OmegaConf.set_struct(merged, True)
    return merged


def _refuse_unknown_keys(node: DictConfig, cls: type, prefix: str) -> None:
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in node.keys():
        path = f"{prefix}{key}"
        if key not in fields:
            raise ConfigKeyError(
                f"config key `{path}` is not in the schema ({cls.__name__} has: "
                f"{', '.join(sorted(fields))}). Check the spelling; "
                "`python -m skyq.config show` prints every valid key."
            )
        sub_type = _dataclass_type(fields[key].type)
        if sub_type is not None and isinstance(node[key], DictConfig):
            _refuse_unknown_keys(node[key], sub_type, f"{path}.")


def _dataclass_type(annotation: object) -> type | None:
    """The schema dataclass a field holds (annotations are strings under `from __future__`)."""
    name = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", "")
    return _SCHEMA_TYPES.get(name)


_SCHEMA_TYPES: dict[str, type] = {
    name: obj for name, obj in vars(schema).items() if dataclasses.is_dataclass(obj) and isinstance(obj, type)
}


def to_object(cfg: DictConfig) -> schema.TrainConfig:
    """The typed dataclass instance of a composed config (after the strict schema check)."""
    return OmegaConf.to_object(strict(cfg))  # type: ignore[return-value]
