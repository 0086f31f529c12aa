"""BF16 HF checkpoint -> FP8 e4m3 (blockwise, per-channel or per-tensor scales).

    python -m skyq.tools.convert_hf_to_fp8 --model-dir D --save-dir S [--strategy block|channel|tensor]
        [--block-size 128 128] [--max-workers N] [--scale-fmt ue8m0] [--overwrite]

What is quantized comes from the model layout (config.json's architecture): attention, dense MLP,
shared and routed expert linears; router, embeddings, lm_head, norms, MTP and vision stay BF16.
A killed run resumes where it stopped when started again with the same arguments.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from skyq.checkpoint.fp8_convert import (
    Fp8Options,
    Fp8Strategy,
    fp8_quantization_config,
    make_fp8_transform,
    merged_row_warnings,
)
from skyq.checkpoint.selection import checked_plan, select
from skyq.tools.cli import (
    add_run_options,
    add_save_dir,
    checkpoint_model_config,
    convert,
    converter_parser,
    positive_int,
    run_tool,
    unquantized_source,
)

TOOL = "convert_hf_to_fp8"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = converter_parser(TOOL, __doc__, model_dir_help="BF16 HF checkpoint to read")
    add_save_dir(p)
    p.add_argument("--strategy", choices=[s.value for s in Fp8Strategy], default="block")
    p.add_argument("--block-size", nargs=2, type=positive_int, default=[128, 128], metavar=("BN", "BK"))
    p.add_argument("--scale-fmt", choices=["ue8m0"], default=None, help="power-of-two scales (block only)")
    add_run_options(p)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    opts = Fp8Options(
        strategy=Fp8Strategy(args.strategy),
        block_size=tuple(args.block_size),
        pow2_scales=args.scale_fmt == "ue8m0",
    )
    source = unquantized_source(args.model_dir)
    model_cfg, precision = checkpoint_model_config(source), opts.precision_config()
    selection = select(source.tensors, model_cfg, precision)
    plan = checked_plan(model_cfg, precision, selection, source.tensors)
    if opts.strategy is Fp8Strategy.block:
        for warning in merged_row_warnings(
            selection.quantized, source.tensors, selection.roles, block_rows=opts.block_size[0]
        ):
            print(warning, file=sys.stderr)
    config = source.config()
    config["quantization_config"] = fp8_quantization_config(opts, plan)
    options = {"strategy": opts.strategy.value, "block_size": list(opts.block_size), "pow2": opts.pow2_scales}
    return convert(
        TOOL,
        args,
        source,
        options=options,
        transform=make_fp8_transform(selection.quantized, opts),
        config=config,
    )


if __name__ == "__main__":
    sys.exit(run_tool(main))
