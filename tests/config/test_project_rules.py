"""Project-wide rules: lean import, defaults only in the schema, generated docs up to date."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_import_skyq_is_lean_and_never_initialises_cuda():
    code = (
        "import sys, skyq, skyq.config.store, skyq.config.validate, skyq.quant; import torch\n"
        "heavy = [m for m in ('vllm', 'megatron', 'transformer_engine', 'triton', 'ray', 'wandb') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
        "assert not torch.cuda.is_initialized()\n"
        "print('lean')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0 and "lean" in out.stdout, out.stderr


def test_no_config_get_with_default_in_skyq():
    pattern = re.compile(r"\b(cfg|config|conf|[a-z_]*_cfg)\.get\(")
    offenders = [
        f"{p.relative_to(ROOT)}:{i}"
        for p in (ROOT / "skyq").rglob("*.py")
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert offenders == [], offenders


def test_every_schema_field_has_a_one_line_docstring():
    import dataclasses

    from skyq.config import schema
    from skyq.config.docs import field_docs

    for obj in vars(schema).values():
        if isinstance(obj, type) and dataclasses.is_dataclass(obj):
            docs = field_docs(obj)
            for f in dataclasses.fields(obj):
                assert f.name in docs and "\n" not in docs[f.name], f"{obj.__name__}.{f.name}"


def test_configuration_doc_is_generated_from_the_schema():
    from skyq.config.docs import render

    assert (ROOT / "docs" / "configuration.md").read_text() == render(), "stale: run `make docs`"


def test_conf_yaml_holds_no_defaults_of_its_own():
    """Group options pick and override; each starts from its schema node."""
    for path in (ROOT / "conf").glob("*/*.yaml"):
        if path.parent.name == "recipe":  # recipes are experiments (@package _global_), not options
            continue
        text = path.read_text()
        assert f"- base_{path.parent.name}" in text, path
        assert "_target_" not in text and "oc.env" not in text, path


def test_every_schema_key_is_read_by_some_backend_or_universal():
    """Item of the backend table (skyq.config.backends): a key nothing reads is a setting accepted and
    silently ignored. A new schema field needs a reader declared there; a new backend adds its entry."""
    from skyq.config.backends import READS, UNIVERSAL, is_universal, leaf_fields, matches, readers

    keys = [key for key, _ in leaf_fields()]
    unread = [k for k in keys if not is_universal(k) and not readers(k)]
    assert unread == [], f"schema keys no backend reads (declare them in skyq/config/backends.py): {unread}"
    for pattern in (*UNIVERSAL, *(p for patterns in READS.values() for p in patterns)):
        assert any(matches(pattern, k) for k in keys), f"backends.py names no schema key: {pattern}"
    both = [k for k in keys if is_universal(k) and readers(k)]
    assert both == [], f"universal and backend-specific at once: {both}"


def test_help_imports_no_torch_and_the_config_cli_nothing_beyond_skyq_config():
    """`python -m skyq.train --help` loaded torch (through preflight -> quant.plan) and Hydra's help
    deep-copied its config repository once per option; `skyq.config`'s CLI reached into skyq.quant."""
    code = (
        "import runpy, sys, io, contextlib\n"
        "sys.argv = ['skyq.train', '--help']\n"
        "with contextlib.redirect_stdout(io.StringIO()) as out:\n"
        "    runpy.run_module('skyq.train', run_name='__main__')\n"
        "assert 'precision: bf16' in out.getvalue(), out.getvalue()\n"
        "import skyq.config.__main__\n"
        "outside = sorted(m for m in sys.modules if m.startswith('skyq.') and not m.startswith('skyq.config')"
        " and m not in ('skyq.train', 'skyq.launch', 'skyq.launch.guards'))\n"
        "assert 'torch' not in sys.modules and not outside, outside\n"
        "print('lean')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0 and "lean" in out.stdout, out.stderr


def test_dry_run_and_the_plan_import_no_torch(tmp_path):
    """`skyq.train dry_run=true` loaded torch (most of its wall time) through the quantization plan,
    the layouts and the strategies, though a dry run handles no tensor. The Kimi recipe (70k tensors,
    INT4); then the plan API of every quantized precision: build, summary, JSON round trip, diff,
    ignore list and quantization_config."""
    code = (
        "import runpy, sys, io, contextlib\n"
        f"sys.argv = ['skyq.train', 'recipe=kimi_k26_int4_qat_256gpu_text', 'dry_run=true', 'hydra.run.dir={tmp_path / 'run'}']\n"
        "with contextlib.redirect_stdout(io.StringIO()) as out:\n"
        "    try:\n"
        "        runpy.run_module('skyq.train', run_name='__main__')\n"
        "    except SystemExit as exc:\n"
        "        assert not exc.code, out.getvalue()\n"
        "assert 'config valid; dry run only' in out.getvalue(), out.getvalue()\n"
        "from omegaconf import OmegaConf\n"
        "from skyq.config.store import compose\n"
        "from skyq.quant.plan import QuantPlan, build_plan\n"
        "from skyq.quant.strategies import get_strategy\n"
        "for precision in ('fp8_blockwise', 'mxfp8', 'int4_qat'):\n"
        "    cfg = OmegaConf.to_object(compose(['model=qwen3_30b', f'precision={precision}']))\n"
        "    plan = build_plan(cfg.model, cfg.precision)\n"
        "    assert plan.wire_bytes < plan.bf16_bytes and plan.summary()\n"
        "    assert QuantPlan.from_json(plan.to_json()).diff(plan) == []\n"
        "    assert get_strategy(cfg.precision).quantization_config(plan) and plan.ignore_list()\n"
        "heavy = sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'numpy', 'transformers', 'ray', 'triton'})\n"
        "assert not heavy, heavy\n"
        "print('lean')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0 and "lean" in out.stdout, out.stderr
