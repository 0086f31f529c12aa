"""Adding each token's routed expert outputs (`skyq.ops.moe_combine`), on the CPU.

The reference is the grouped experts' former torch code, itself tested against the per-expert loop
(tests/rollout/test_grouped_experts.py). The one-launch Triton kernel is checked against it bit for
bit under the Triton interpreter (where Triton is importable; skipped where Triton is not installed),
in a subprocess because TRITON_INTERPRET must be set before `@triton.jit` runs; tests/gpu checks
it on the H200.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from skyq.ops.moe_combine import combine, combine_reference
from tests.interpreter_run import kernels_on_cpu, report, run_under_interpreter, seeded_generator

ROOT = Path(__file__).resolve().parents[2]


def routed_rows(gen: torch.Generator, t: int, k: int, experts: int, h: int, w_dtype: torch.dtype):
    """(down, order, top_k_index, top_k_weights) as `WireExperts._grouped_forward` builds them: k
    distinct experts per token, rows sorted by expert (stable), bf16 rows of mixed magnitude, weights
    in the rows' dtype (the router casts them to it)."""
    top_k_index = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(t)])
    top_k_weights = torch.softmax(torch.randn(t, k, generator=gen), dim=-1).to(w_dtype)
    order = torch.argsort(top_k_index.reshape(-1), stable=True)
    down = (
        torch.randn(t * k, h, generator=gen) * 10.0 ** torch.randint(-2, 3, (t * k, 1), generator=gen)
    ).to(torch.bfloat16)
    return down, order, top_k_index, top_k_weights


def test_off_cuda_combine_is_the_reference_and_sums_in_ascending_expert_order():
    gen = torch.Generator().manual_seed(0)
    down, order, idx, w = routed_rows(gen, 5, 4, 16, 64, torch.bfloat16)
    out = combine(down, order, idx, w, torch.bfloat16)
    assert torch.equal(out, combine_reference(down, order, idx, w, torch.bfloat16))
    # the same sums, written out: token by token, its experts ascending, a bf16 rounding per add
    position = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel()))
    for tok in range(5):
        acc = torch.zeros(64, dtype=torch.bfloat16)
        for slot in torch.argsort(idx[tok]).tolist():
            row = down[position[tok * 4 + slot]]
            acc = acc + (row * w[tok, slot]).to(torch.bfloat16)
        assert torch.equal(out[tok], acc)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_combine_kernel_matches_the_reference_under_the_triton_interpreter():
    run_under_interpreter(str(Path(__file__)), marker="interpreter: combine matches")


def _interpreter_main() -> None:
    from skyq.ops import moe_combine

    kernels_on_cpu()
    gen = seeded_generator()
    failures = []
    for t, k, experts, h, w_dtype in [(1, 4, 8, 300, torch.bfloat16), (7, 8, 32, 256, torch.bfloat16),
                                      (5, 6, 12, 513, torch.bfloat16), (3, 1, 4, 64, torch.bfloat16)]:  # fmt: skip
        down, order, idx, w = routed_rows(gen, t, k, experts, h, w_dtype)
        got = moe_combine.combine(down, order, idx, w, torch.bfloat16)  # the kernel (kernels_on_cpu)
        if not torch.equal(got, combine_reference(down, order, idx, w, torch.bfloat16)):
            failures.append((t, k, experts, h, w_dtype))
    report("combine", failures)


if __name__ == "__main__" and "--interpret" in sys.argv:
    sys.path.insert(0, str(ROOT))
    _interpreter_main()
