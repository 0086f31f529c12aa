"""Every recipe has a launch script, and the scripts run (dry) as a user runs them."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "train" / "fp8"


def test_one_launch_script_per_recipe():
    recipes = {p.stem for p in (ROOT / "recipes").glob("*.yaml")}
    scripts = {p.stem.removeprefix("run_") for p in EXAMPLES.glob("run_*.sh")}
    assert recipes == scripts
    readme = (EXAMPLES / "README.md").read_text()
    for name in scripts:
        assert f"run_{name}.sh" in readme


def test_a_gpu_launch_script_dry_runs_with_its_env(tmp_path):
    env = {
        **os.environ,
        "DRY_RUN": "1",
        "ROLLOUT_CKPT": str(tmp_path / "absent"),
        "PY": str(Path(os.sys.executable)),
    }
    out = subprocess.run(
        [str(EXAMPLES / "run_qwen3_30b_int4_qat_8gpu.sh"), f"output_root={tmp_path}"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert f"checkpoint.rollout_checkpoint={tmp_path / 'absent'} does not exist here" in out.stdout
