"""FP8 e4m3 HF checkpoint -> BF16 (blockwise, per-channel, per-tensor or MXFP8 scales, from config.json).

    python -m skyq.tools.convert_fp8_to_bf16 --model-dir D --save-dir S [--max-workers N] [--overwrite]

Every FP8 weight is dequantized with its scale, wherever the index puts it; a weight without its
scale stops the run (it is never copied as is). `quantization_config` is removed from config.json.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from skyq.checkpoint.fp8_dequant import (
    fp8_layout_from_config,
    make_fp8_dequant_transform,
    pair_fp8_weights,
    strip_quantization_config,
)
from skyq.checkpoint.reader import CONFIG_NAME, ShardedCheckpoint
from skyq.tools.cli import add_run_options, add_save_dir, convert, converter_parser, run_tool

TOOL = "convert_fp8_to_bf16"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = converter_parser(TOOL, __doc__, model_dir_help="FP8 HF checkpoint to read")
    add_save_dir(p)
    add_run_options(p)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    source = ShardedCheckpoint(args.model_dir)
    config = source.config()
    layout = fp8_layout_from_config(config, str(source.dir / CONFIG_NAME))
    pairs = pair_fp8_weights(source.tensors, layout)
    strip_quantization_config(config)
    return convert(
        TOOL, args, source, options={"scale_suffix": layout.scale_suffix, "block_size": layout.block_size},
        transform=make_fp8_dequant_transform(source, pairs, layout), config=config,
    )  # fmt: skip


if __name__ == "__main__":
    sys.exit(run_tool(main))
