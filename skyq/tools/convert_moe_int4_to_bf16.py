"""W4A16 INT4 (compressed-tensors pack-quantized) checkpoint -> BF16, e.g. Kimi-K2.6 for the trainer.

    python -m skyq.tools.convert_moe_int4_to_bf16 --model-dir D [--output-dir O (default D_bf16)]
        [--files F ...] [--config-path P] [--overwrite] [--keep-quantization-config]

Writes `quantization_config.json` next to config.json: the removed block, with unquantized
top-level namespaces (vision_tower, mm_projector) added to its ignore list. Asymmetric inputs are
dequantized with their zero points. `--files` converts a subset of shards; the index and config
appear once every shard is done. A killed run resumes; `--overwrite` starts over.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from skyq.checkpoint.fp8_dequant import find_quantization_config, strip_quantization_config
from skyq.checkpoint.int4_dequant import (
    group_packed_weights,
    make_int4_dequant_transform,
    packed_layout_from_block,
    sidecar_block,
)
from skyq.checkpoint.reader import CONFIG_NAME, ShardedCheckpoint, load_json
from skyq.tools.cli import add_run_options, convert, converter_parser, run_tool

TOOL = "convert_moe_int4_to_bf16"
SIDECAR_NAME = "quantization_config.json"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = converter_parser(TOOL, __doc__, model_dir_help="INT4 checkpoint to read")
    p.add_argument("--output-dir", type=Path, default=None, help="output dir (default: <model-dir>_bf16)")
    p.add_argument("--files", nargs="+", default=None, help="convert only these shard files")
    p.add_argument(
        "--config-path", type=Path, default=None, help="config.json holding the quantization_config"
    )
    p.add_argument(
        "--keep-quantization-config", action="store_true", help="leave the block in config.json too"
    )
    add_run_options(p, overwrite_help="reconvert shards already in --output-dir")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    source = ShardedCheckpoint(args.model_dir)
    output_dir = args.output_dir or source.dir.with_name(source.dir.name + "_bf16")
    config_path = args.config_path or source.dir / CONFIG_NAME
    block = find_quantization_config(load_json(config_path))
    layout = packed_layout_from_block(block, str(config_path))
    units = group_packed_weights(source.tensors, layout)
    if args.files is not None:
        unknown = sorted(set(args.files) - set(source.shard_names))
        if unknown:
            raise ValueError(f"--files: {unknown[0]!r} is not a shard of {source.dir}")
    config = source.config()
    if not args.keep_quantization_config:
        strip_quantization_config(config)
    options = {"group_size": layout.group_size, "symmetric": layout.symmetric,
               "keep_quantization_config": args.keep_quantization_config}  # fmt: skip
    return convert(
        TOOL, args, source, save_dir=output_dir, options=options,
        transform=make_int4_dequant_transform(source, units, layout), config=config,
        extra_json={SIDECAR_NAME: sidecar_block(block, source.tensors)}, shards=args.files,
    )  # fmt: skip


if __name__ == "__main__":
    sys.exit(run_tool(main))
