"""`python -m skyq.config ls | show [overrides...] | validate <recipe file> [overrides...] | cp <recipe> <dest>`.

The config-level checks only (`skyq.config.validate`): skyq.config imports nothing else of skyq, so the
checks that need the quantization plan (the INT4 checkpoint's ignore list against
precision.qat_scope, the embedded pair's model-size limit) run in `python -m skyq.train ... dry_run=true`.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

from omegaconf import OmegaConf

from skyq.config.store import CONF_DIR, GROUPS, compose, to_object
from skyq.config.validate import validate

RECIPES_DIR = CONF_DIR.parent / "recipes"


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def cmd_ls(_: argparse.Namespace) -> int:
    for group in GROUPS:
        print(f"{group:<10} {' '.join(_options(group))}")
    print("recipes:")
    for path in sorted(RECIPES_DIR.glob("*.yaml")):
        header = path.read_text().splitlines()[1].lstrip("# ").strip()
        print(f"  {path.stem:<40} {header}")
    return 0


def _report(overrides: list[str]) -> int:
    report = validate(to_object(compose(overrides)))
    for note in report.skipped:
        print(f"not checked: {note}")
    print(
        "not checked here: the plan-level checks (INT4 ignore list vs precision.qat_scope, the embedded "
        "pair's model size); `python -m skyq.train <the same overrides> dry_run=true` makes them."
    )
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    cfg = compose(args.overrides)
    print(OmegaConf.to_yaml(cfg))
    validate(to_object(cfg))
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    """Validate a recipe file from anywhere, as if it were in recipes/."""
    src = Path(args.file).resolve()
    if not src.is_file():
        raise ValueError(f"{src}: no such recipe file")
    with tempfile.TemporaryDirectory() as tmp:
        # Hydra finds a config group on its search path: put the file in a one-file group there.
        (Path(tmp) / "user_recipe").mkdir()
        shutil.copy(src, Path(tmp) / "user_recipe" / f"{src.stem}.yaml")
        rc = _report([f"hydra.searchpath=[file://{tmp}]", *args.overrides, f"+user_recipe={src.stem}"])
    print(f"{src}: valid")
    return rc


def cmd_cp(args: argparse.Namespace) -> int:
    src = RECIPES_DIR / f"{args.recipe}.yaml"
    if not src.is_file():
        raise ValueError(f"no recipe `{args.recipe}`; `python -m skyq.config ls` lists them")
    dest = Path(args.dest)
    if dest.is_dir():
        dest = dest / src.name  # `cp <recipe> <folder>` puts it in the folder, as cp(1) does
    if dest.exists():
        raise ValueError(f"{dest} exists; refusing to overwrite it")
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        with dest.open("xb") as out:
            out.write(src.read_bytes())
    except OSError as exc:
        raise ValueError(f"cannot write {dest}: {exc.strerror}") from None
    print(f"copied {src} -> {dest}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m skyq.config", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("ls", help="list config groups, their options and the recipes").set_defaults(fn=cmd_ls)
    show = sub.add_parser("show", help="print the resolved config tree for the given overrides")
    show.add_argument("overrides", nargs="*")
    show.set_defaults(fn=cmd_show)
    val = sub.add_parser("validate", help="compose and validate a recipe file (from anywhere)")
    val.add_argument("file")
    val.add_argument("overrides", nargs="*")
    val.set_defaults(fn=cmd_validate)
    cp = sub.add_parser("cp", help="copy a recipe to edit it")
    cp.add_argument("recipe")
    cp.add_argument("dest")
    cp.set_defaults(fn=cmd_cp)
    args = parser.parse_args(argv)
    try:
        return args.fn(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
