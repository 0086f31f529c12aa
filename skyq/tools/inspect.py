"""Describe and check a HF safetensors checkpoint.

    python -m skyq.tools.inspect D [--verify]

Prints the format, quantized/kept tensors by role, scale sanity, index/config consistency and
bytes. Exits 1 when a problem is found; `--verify` also reads every tensor and checks every file
against skyq_manifest.json (which catches zero-filled or bit-flipped payloads).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from skyq.checkpoint.inspect_checkpoint import inspect_checkpoint


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m skyq.tools.inspect", description=__doc__.split("\n")[0])
    p.add_argument("model_dir", type=Path, help="checkpoint directory")
    p.add_argument("--verify", action="store_true", help="read every tensor and check the manifest checksums")
    args = p.parse_args(argv)
    report = inspect_checkpoint(args.model_dir, verify=args.verify)
    print(report.render())
    return 1 if report.problems else 0


if __name__ == "__main__":
    sys.exit(main())
