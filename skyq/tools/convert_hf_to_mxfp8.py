"""BF16 HF checkpoint -> MXFP8 (compressed-tensors `mxfp8-quantized`, the rollout checkpoint of mxfp8 runs).

    python -m skyq.tools.convert_hf_to_mxfp8 --model-dir D --save-dir S [--targets routed_experts|all_linear]
        [--max-workers N] [--overwrite]

What is quantized comes from the model layout (config.json's architecture) and the mxfp8 strategy's
scope, exactly as `precision.mxfp8_targets`: routed-expert linears by default, `all_linear` adds
attention, dense MLP and shared experts; router, embeddings, lm_head, norms, MTP and vision stay BF16.
`X.weight` e4m3 + `X.weight_scale` uint8 E8M0 [N, K/32], written by the strategy's `serialize` (the
bytes the weight sync pushes). A killed run resumes where it stopped when started again with the
same arguments.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from skyq.checkpoint.mxfp8_convert import check_mx_divisibility, make_mxfp8_transform
from skyq.checkpoint.selection import checked_plan, select
from skyq.config.enums import Precision, QuantScope
from skyq.config.schema import PrecisionConfig
from skyq.quant.strategies import get_strategy
from skyq.tools.cli import (
    add_run_options,
    add_save_dir,
    checkpoint_model_config,
    convert,
    converter_parser,
    run_tool,
    unquantized_source,
)

TOOL = "convert_hf_to_mxfp8"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = converter_parser(TOOL, __doc__, model_dir_help="BF16 HF checkpoint to read")
    add_save_dir(p)
    p.add_argument(
        "--targets",
        choices=[s.value for s in QuantScope],
        default=QuantScope.routed_experts.value,
        help="linears to quantize, as precision.mxfp8_targets (default: routed_experts)",
    )
    add_run_options(p)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    precision = PrecisionConfig(name=Precision.mxfp8, mxfp8_targets=QuantScope(args.targets))
    source = unquantized_source(args.model_dir)
    model_cfg = checkpoint_model_config(source)
    selection = select(source.tensors, model_cfg, precision)
    if not selection.quantized:
        raise ValueError(f"{source.dir}: no linear of --targets {args.targets} to quantize")
    check_mx_divisibility(selection.quantized, source.tensors)
    strategy = get_strategy(precision)
    config = source.config()
    config["quantization_config"] = strategy.quantization_config(
        checked_plan(model_cfg, precision, selection, source.tensors)
    )
    return convert(
        TOOL, args, source, options={"targets": args.targets, **strategy.wire_settings()},
        transform=make_mxfp8_transform(selection, strategy), config=config,
    )  # fmt: skip


if __name__ == "__main__":
    sys.exit(run_tool(main))
