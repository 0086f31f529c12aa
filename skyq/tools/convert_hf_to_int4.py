"""BF16 HF checkpoint -> W4A16 INT4 (compressed-tensors pack-quantized, symmetric by default).

    python -m skyq.tools.convert_hf_to_int4 --model-dir D --save-dir S [--group-size G] [--grid kimi|rtn]
        [--is-symmetric] [--asymmetric] [--ignore-rules R ...] [--max-workers N] [--overwrite]

Routed-expert linears are quantized (the layout of config.json's architecture decides which tensors
those are); `--ignore-rules` (compressed-tensors module rules: `re:<regex>` or an exact module name)
keeps more modules in BF16. Symmetric is the default; `--is-symmetric` is accepted for seed launch
scripts and changes nothing.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from skyq.checkpoint.int4_convert import (
    Int4Options,
    check_group_divisibility,
    int4_quantization_config,
    make_int4_transform,
    matches_ignore_rule,
)
from skyq.checkpoint.selection import checked_plan, select
from skyq.config.enums import Int4Grid
from skyq.quant.layouts import get_layout
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

TOOL = "convert_hf_to_int4"
ASYMMETRIC_WARNING = (
    "warning: --asymmetric writes zero points; such a checkpoint cannot serve INT4 QAT (skyq's STE is "
    "symmetric and an asymmetric rollout checkpoint is refused by int4_qat runs)"
)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = converter_parser(TOOL, __doc__, model_dir_help="BF16 HF checkpoint to read")
    add_save_dir(p)
    p.add_argument(
        "--group-size", type=positive_int, default=32, help="INT4 group along K (seed default 32; Qwen3: 128)"
    )
    p.add_argument(
        "--grid", choices=[g.value for g in Int4Grid], default="kimi", help="kimi: /7 [-7,7]; rtn: /7.5"
    )
    p.add_argument(
        "--is-symmetric", action="store_true", help="accepted for compatibility: symmetric is the default"
    )
    p.add_argument("--asymmetric", action="store_true", help="zero-point groups (cannot serve INT4 QAT)")
    p.add_argument(
        "--ignore-rules", nargs="+", default=[], help="extra modules kept BF16 (re:<regex> or name)"
    )
    add_run_options(p)
    args = p.parse_args(argv)
    if args.asymmetric and args.is_symmetric:
        p.error("--asymmetric and --is-symmetric contradict each other")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.asymmetric:
        print(ASYMMETRIC_WARNING, file=sys.stderr)
    opts = Int4Options(group_size=args.group_size, grid=Int4Grid(args.grid), symmetric=not args.asymmetric)
    source = unquantized_source(args.model_dir)
    model_cfg, precision = checkpoint_model_config(source), opts.precision_config()
    selection = select(source.tensors, model_cfg, precision)
    module_of = get_layout(model_cfg.family).module_name
    user_ignored = {
        n for n in selection.quantized if any(matches_ignore_rule(module_of(n), r) for r in args.ignore_rules)
    }
    quantized = selection.quantized - user_ignored
    if not quantized:
        raise ValueError(f"{source.dir}: no routed-expert linear left to quantize (check --ignore-rules)")
    check_group_divisibility(selection.quantized, source.tensors, opts.group_size)
    plan = checked_plan(model_cfg, precision, selection, source.tensors)
    config = source.config()
    config["quantization_config"] = int4_quantization_config(opts, plan, args.ignore_rules)
    options = {"group_size": opts.group_size, "grid": opts.grid.value, "symmetric": opts.symmetric,
               "ignore_rules": sorted(args.ignore_rules)}  # fmt: skip
    return convert(
        TOOL,
        args,
        source,
        options=options,
        transform=make_int4_transform(frozenset(quantized), opts),
        config=config,
    )


if __name__ == "__main__":
    sys.exit(run_tool(main))
