"""What every skyq tool shares: the error contract and reading a checkpoint's model config."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence

from skyq.checkpoint.hf_config import model_config_from_hf
from skyq.checkpoint.reader import ShardedCheckpoint
from skyq.config.schema import ModelConfig


def run_tool(main: Callable[[Sequence[str] | None], int], argv: Sequence[str] | None = None) -> int:
    """Run a tool's `main`; a bad input (any ValueError: checkpoint, config, quantization) becomes
    one `error:` line on stderr and exit status 2 instead of a traceback."""
    try:
        return main(argv)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def checkpoint_model_config(source: ShardedCheckpoint) -> ModelConfig:
    """The skyq model config of a checkpoint, derived from its config.json."""
    try:
        return model_config_from_hf(source.config())
    except ValueError as e:
        raise ValueError(f"{source.dir / 'config.json'}: {e}") from e
