"""What every skyq tool shares: the error contract, the converters' common flags and reading a
checkpoint's model config."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from skyq.checkpoint.fp8_convert import check_fp8_input
from skyq.checkpoint.hf_config import model_config_from_hf
from skyq.checkpoint.job import ConversionJob, run_job
from skyq.checkpoint.pipeline import ShardTransform
from skyq.checkpoint.reader import ShardedCheckpoint
from skyq.config.schema import ModelConfig


def run_tool(main: Callable[[Sequence[str] | None], int], argv: Sequence[str] | None = None) -> int:
    """Run a tool's `main`; a bad input (any ValueError: argument, checkpoint, config, quantization)
    becomes one `error:` line on stderr and exit status 2 instead of a traceback. So does an OSError
    no layer below explained (converters turn their own write failures into ValueErrors that name
    the file and the fix)."""
    try:
        return main(argv)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


class UsageError(ValueError):
    """A command line the tool's parser refuses (unknown flag, missing or malformed value)."""


class ToolArgumentParser(argparse.ArgumentParser):
    """An argparse parser whose refusals are `UsageError`s, so `run_tool` prints them as its one
    `error:` line (argparse itself prints the usage and exits)."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see {self.prog} --help)")


def positive_int(text: str) -> int:
    """argparse type of a count or size flag (`--max-workers`, `--block-size`, `--group-size`)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def converter_parser(tool: str, doc: str, *, model_dir_help: str) -> argparse.ArgumentParser:
    """A converter's parser: `python -m skyq.tools.<tool>`, the first line of its module docstring,
    and `--model-dir` (the checkpoint it reads, described by `model_dir_help`)."""
    p = ToolArgumentParser(prog=f"python -m skyq.tools.{tool}", description=doc.split("\n")[0])
    p.add_argument("--model-dir", required=True, type=Path, help=model_dir_help)
    return p


def add_save_dir(p: argparse.ArgumentParser) -> None:
    p.add_argument("--save-dir", required=True, type=Path, help="output dir (not inside --model-dir)")


def add_max_workers(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--max-workers", type=positive_int, default=1, help="converter threads (memory: ~1 shard each)"
    )


def add_device(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--device", default=None, metavar="DEVICE",
        help="where the arithmetic runs: cpu or cuda[:N] (default: cuda if a GPU is visible, else cpu); "
        "the output bytes are the same",
    )  # fmt: skip


OVERWRITE_HELP = (
    "replace the files this conversion writes if they exist (a finished or partial output, another "
    "checkpoint); other files are left as they are"
)


def add_overwrite(p: argparse.ArgumentParser, *, help: str = OVERWRITE_HELP) -> None:
    p.add_argument("--overwrite", action="store_true", help=help)


def add_run_options(p: argparse.ArgumentParser, *, overwrite_help: str = OVERWRITE_HELP) -> None:
    """`--max-workers`, `--device` and `--overwrite`: how a converter runs, never what it writes."""
    add_max_workers(p)
    add_device(p)
    add_overwrite(p, help=overwrite_help)


def unquantized_source(model_dir: Path) -> ShardedCheckpoint:
    """The checkpoint a quantizing converter reads, refused if it is already quantized."""
    source = ShardedCheckpoint(model_dir)
    check_fp8_input({n: info.dtype for n, info in source.tensors.items()})
    return source


def convert(
    tool: str,
    args: argparse.Namespace,
    source: ShardedCheckpoint,
    *,
    options: dict[str, Any],
    transform: ShardTransform,
    config: dict[str, Any],
    save_dir: Path | None = None,
    **job: Any,
) -> int:
    """Run one conversion job with the run options of `add_run_options` (and `args.save_dir` unless
    `save_dir` is given); exit status 0."""
    run_job(
        ConversionJob(
            tool=tool, source=source, save_dir=save_dir or args.save_dir, options=options,
            transform=transform, config=config, max_workers=args.max_workers, device=args.device,
            overwrite=args.overwrite, **job,
        )
    )  # fmt: skip
    return 0


def checkpoint_model_config(source: ShardedCheckpoint) -> ModelConfig:
    """The skyq model config of a checkpoint, derived from its config.json."""
    try:
        return model_config_from_hf(source.config())
    except ValueError as e:
        raise ValueError(f"{source.dir / 'config.json'}: {e}") from e
