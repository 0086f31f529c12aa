"""One conversion from start to finish: verify input, resume output, convert, copy, finalize.

Each converter builds a `ConversionJob` (its options, its per-shard transform and the config it
writes) after validating the input from shard headers alone, so bad input is refused before any
output file exists. `run_job` does the rest the same way for every converter, and refuses to
finish (no index, config or manifest) when an input shard changed while it was being converted.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from skyq.checkpoint.atomic import TEMP_MARKER
from skyq.checkpoint.device import resolve_device
from skyq.checkpoint.errors import CheckpointError
from skyq.checkpoint.manifest import MANIFEST_NAME
from skyq.checkpoint.output import DONE_LOG_NAME, ConversionOutput
from skyq.checkpoint.pipeline import ConversionStats, ShardTransform, run_conversion
from skyq.checkpoint.reader import CONFIG_NAME, INDEX_NAME, ShardedCheckpoint, check_inside_model_tree

_NEVER_COPIED = {INDEX_NAME, CONFIG_NAME, MANIFEST_NAME, DONE_LOG_NAME}


@dataclass
class ConversionJob:
    tool: str
    source: ShardedCheckpoint
    save_dir: Path
    options: dict[str, Any]
    """Everything that changes the output bytes; part of the resume fingerprint and the manifest."""
    transform: ShardTransform
    config: dict[str, Any]
    """The config.json to write."""
    extra_json: dict[str, Any] = field(default_factory=dict)
    """Other JSON files to write next to config.json (e.g. the quantization_config.json sidecar)."""
    shards: list[str] | None = None
    """Convert only these shards (None: all); the index and config are written once all are done."""
    max_workers: int = 1
    overwrite: bool = False
    device: str | None = None
    """Where the arithmetic runs (`cpu`, `cuda[:N]`; None: cuda if available); never changes the output."""

    def __post_init__(self) -> None:
        if self.max_workers < 1:
            raise ValueError(f"--max-workers {self.max_workers}: must be at least 1 (converter threads)")


def files_to_copy(model_dir: Path, skip: set[str]) -> list[str]:
    """Relative paths of the non-weight files (tokenizer, generation config, code...) to carry over;
    refuses one that a symlink takes outside the model dir (its bytes would land in the output)."""
    out = []
    for path in sorted(model_dir.rglob("*")):
        rel = path.relative_to(model_dir)
        if any(part.startswith(".") for part in rel.parts) or TEMP_MARKER in path.name:
            continue
        if not path.is_file() or path.suffix == ".safetensors" or rel.as_posix() in _NEVER_COPIED | skip:
            continue
        if path.is_symlink():
            check_inside_model_tree(model_dir, path, "a file to copy")
        out.append(rel.as_posix())
    return out


def run_job(job: ConversionJob) -> ConversionStats:
    """Run `job`; prints a summary line. Returns the statistics."""
    source = job.source
    device = resolve_device(job.device)
    source.verify_checksums()
    all_shards = source.shard_names
    output = ConversionOutput(
        save_dir=job.save_dir, model_dir=source.dir, tool=job.tool, options=job.options,
        inputs=source.identity(), config=job.config, extra_json=job.extra_json,
        copied=files_to_copy(source.dir, set(job.extra_json)), overwrite=job.overwrite,
    )  # fmt: skip
    selected = all_shards if job.shards is None else [s for s in all_shards if s in set(job.shards)]
    stats = run_conversion(
        source=source, output=output, shards=selected, transform=job.transform, max_workers=job.max_workers,
        tool=job.tool, device=device,
    )  # fmt: skip
    missing = [s for s in all_shards if s not in output.done]
    if missing:
        print(f"{job.tool}: {len(missing)} of {len(all_shards)} shard(s) still to convert (e.g. {missing[0]}); "
              "index and config are written once all are done")  # fmt: skip
    else:
        changed = source.changed_inputs()
        if changed:
            raise CheckpointError(
                f"{changed[0]}: changed while it was being converted; the output is left unfinished "
                "(no index or config): run the command again with --overwrite to convert the new input"
            )
        output.finalize()
    print(stats.summary(job.tool), file=sys.stdout, flush=True)
    return stats
