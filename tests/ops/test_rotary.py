"""skyq's rotary embedding (`skyq.ops.rotary`), on the CPU.

`install` makes transformers' Qwen3-MoE attention call it; off CUDA it is the stock function. The
Triton kernel must equal the stock function bit for bit (its roundings are the stock ops'): checked
under the Triton interpreter (where Triton is importable; the set-up installs it) and on the H200
(tests/gpu/test_rotary_gpu.py), on the layouts attention passes (q and k transposed views).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from skyq.ops import rotary
from skyq.quant.kernels import dispatch
from tests.interpreter_run import kernels_on_cpu, report, run_under_interpreter, seeded_generator

ROOT = Path(__file__).resolve().parents[2]


def attention_inputs(gen, b, t, hq, hk, d, dtype, device="cpu", cos_rows=None):
    """q, k as attention makes them ([B, T, H, D] projections viewed as [B, H, T, D]) and the
    rotary embedding's cos, sin [cos_rows (default B), T, D] (position-dependent, |values| <= 1;
    one row when every sequence is at the same positions, as in the engine's decode)."""
    q = (torch.randn(b, t, hq, d, generator=gen) * 4).to(dtype).to(device).transpose(1, 2)
    k = (torch.randn(b, t, hk, d, generator=gen) * 4).to(dtype).to(device).transpose(1, 2)
    angle = torch.rand(cos_rows or b, t, d // 2, generator=gen) * 100
    cos = torch.cat([angle.cos(), angle.cos()], dim=-1).to(dtype).to(device)
    sin = torch.cat([angle.sin(), angle.sin()], dim=-1).to(dtype).to(device)
    return q, k, cos, sin


def check_rotary(gen, device="cpu") -> list[str]:
    """The kernel path's q and k against the stock function's, bit for bit, with the stock layout
    (bf16 through the kernel, fp32 and fp16 through the stock function)."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import rotate_half

    def stock(q, k, cos, sin):  # transformers' formula, written from its definition
        c, s = cos.unsqueeze(1), sin.unsqueeze(1)
        return q * c + rotate_half(q) * s, k * c + rotate_half(k) * s

    failures = []
    for b, t, hq, hk, d, dtype, rows in [
        (1, 1, 16, 4, 128, torch.bfloat16, None), (3, 1, 8, 8, 64, torch.bfloat16, None),
        (2, 9, 4, 2, 128, torch.bfloat16, None), (1, 7, 2, 1, 32, torch.bfloat16, None),
        (6, 1, 16, 4, 128, torch.bfloat16, 1), (5, 3, 4, 2, 64, torch.bfloat16, 1),
        (2, 5, 6, 3, 64, torch.float32, None), (1, 7, 2, 1, 32, torch.float16, None),
    ]:  # fmt: skip
        q, k, cos, sin = attention_inputs(gen, b, t, hq, hk, d, dtype, device, rows)
        if (
            dtype == torch.bfloat16
            and dispatch.uses_kernel(q)
            and not rotary._kernel_applies(q, k, cos, sin, 1)
        ):
            failures.append(f"{(b, t, hq, hk, d, rows)}: the kernel refused a bf16 attention shape")
        got, want = rotary.apply_rotary_pos_emb(q, k, cos, sin), stock(q, k, cos, sin)
        for name, g, w in zip("qk", got, want, strict=True):
            if not torch.equal(g, w):
                failures.append(f"{name} {(b, t, hq, hk, d, dtype)}: differs")
            if (
                g.is_contiguous() != w.is_contiguous()
                or g.transpose(1, 2).is_contiguous() != w.transpose(1, 2).is_contiguous()
            ):
                failures.append(f"{name} {(b, t, hq, hk, d, dtype)}: layout {g.stride()} vs {w.stride()}")  # fmt: skip
    return failures


def test_install_routes_transformers_attention_through_skyq_and_cpu_runs_the_stock_function():
    from transformers.models.qwen3_moe import modeling_qwen3_moe as modeling

    rotary.install()
    rotary.install()  # idempotent: the stock function is kept once
    assert modeling.apply_rotary_pos_emb is rotary.apply_rotary_pos_emb
    assert rotary._stock is not None and rotary._stock is not rotary.apply_rotary_pos_emb
    gen = torch.Generator().manual_seed(0)
    q, k, cos, sin = attention_inputs(gen, 2, 5, 4, 2, 64, torch.bfloat16)
    for got, want in zip(
        rotary.apply_rotary_pos_emb(q, k, cos, sin), rotary._stock(q, k, cos, sin), strict=True
    ):
        assert torch.equal(got, want)
    assert check_rotary(gen) == []  # on the CPU: the stock function itself


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_rotary_kernel_under_the_triton_interpreter():
    run_under_interpreter(str(Path(__file__)), marker="interpreter: rotary matches")


def _interpreter_main() -> None:
    kernels_on_cpu()
    rotary.install()
    failures = check_rotary(seeded_generator())
    report("rotary", failures)


if __name__ == "__main__" and "--interpret" in sys.argv:
    sys.path.insert(0, str(ROOT))
    _interpreter_main()
