#!/usr/bin/env bash
# Builds .gpu_bundle/: what the lent GPU box (Python 3.12, torch, transformers, safetensors, no hydra and
# no Ray, nothing reachable) needs to run `python -m skyq.train` on any topology, small enough to carry
# (64 MiB per call): the hydra/omegaconf wheels, Ray's missing dependencies, and Ray itself without the
# parts skyq never loads (Java jars, the dashboard's web client, rllib/data/serve/train/tune/llm), xz-packed.
# On the box: `source scripts/gpu_box_env.sh` (carry .gpu_bundle). Idempotent: skips what is there.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=.gpu_bundle
RAY=${RAY_VERSION:-2.60.0}
PIP=${PIP:-.venv/bin/python -m pip}
mkdir -p "$OUT/wheels"
fetch() {  # wheels for CPython 3.12 on manylinux x86-64 (the box), without their dependencies
  $PIP download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$OUT/wheels" "$@"
}
[ -n "$(ls "$OUT"/wheels/hydra_core-* 2>/dev/null)" ] || fetch hydra-core==1.3.8 omegaconf==2.3.1 \
  jsonschema==4.25.1 jsonschema-specifications==2025.9.1 referencing==0.36.2 rpds-py==0.27.1
[ -n "$(ls "$OUT"/wheels/antlr4_python3_runtime-* 2>/dev/null)" ] || \
  $PIP wheel --quiet --no-deps antlr4-python3-runtime==4.9.3 -w "$OUT/wheels"  # sdist only on PyPI
if [ ! -f "$OUT/ray-$RAY-slim.tar.xz" ]; then
  tmp=$(mktemp -d)
  fetch_dir="$tmp/whl"; mkdir -p "$fetch_dir"
  $PIP download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux2014_x86_64 -d "$fetch_dir" "ray==$RAY"
  mkdir "$tmp/site"
  python3 - "$fetch_dir"/ray-*.whl "$tmp/site" <<'PY'  # unzip keeping the executables' mode bits
import os, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    for info in z.infolist():
        path = z.extract(info, sys.argv[2])
        mode = info.external_attr >> 16
        if mode and not info.is_dir():
            os.chmod(path, mode & 0o777)
PY
  rm -rf "$tmp/site/ray/jars" "$tmp/site/ray/dashboard/client" "$tmp/site/ray/rllib" "$tmp/site/ray/data" \
    "$tmp/site/ray/serve" "$tmp/site/ray/train" "$tmp/site/ray/tune" "$tmp/site/ray/llm"
  tar -C "$tmp/site" -cf - . | xz -6 -T0 > "$OUT/ray-$RAY-slim.tar.xz"
  rm -rf "$tmp"
fi
du -sh "$OUT"
