"""Register the schema with Hydra's ConfigStore and compose configurations.

Every group option in conf/ starts from a `base_<group>` node registered here, so unknown keys and
wrong types fail at compose time with the full key path.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import tempfile
import uuid
from pathlib import Path

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from skyq.config import schema

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"
"""The `conf/` directory of the source tree (skyq is installed editable)."""

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
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = hydra_compose(config_name="train", overrides=list(overrides))
    return strict(cfg)


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
