"""Where the grouped experts put each routed row (`skyq.ops.moe_route`), on the CPU.

The reference is checked against its definition (rows by expert, then flat index; offsets bound
each expert's rows; position inverts order). The Triton kernel must give the same
integers: checked under the Triton interpreter (where Triton is importable; the set-up installs it)
and on the H200 (tests/gpu/test_moe_route_gpu.py).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from skyq.ops import moe_route
from skyq.ops.moe_route import route, route_reference
from tests.interpreter_run import kernels_on_cpu, report, run_under_interpreter, seeded_generator

ROOT = Path(__file__).resolve().parents[2]
CASES = [
    (1, 4, 32),
    (7, 8, 128),
    (64, 8, 128),
    (64, 4, 32),
    (5, 1, 3),
    (13, 2, 4),
    (100, 5, 16),
    (130, 8, 64),
    (171, 3, 7),  # 513 entries: the block-counting launches from here
    (300, 8, 128),
    (97, 8, 384),
]


def routing(gen: torch.Generator, t: int, k: int, experts: int) -> torch.Tensor:
    """top_k_index [t, k] as the router gives it: k distinct experts per token, few experts hot."""
    hot = torch.rand(experts, generator=gen) ** 4  # uneven load, some experts empty
    return torch.stack([torch.multinomial(hot + 1e-3, k, generator=gen) for _ in range(t)])


def check_route(got: moe_route.Route, want: moe_route.Route) -> bool:
    return all(torch.equal(g, w) and g.dtype == w.dtype for g, w in zip(got, want, strict=True))


@pytest.mark.parametrize("t,k,experts", CASES)
def test_reference_sorts_rows_by_expert_then_index_and_bounds_each_expert(t, k, experts):
    idx = routing(torch.Generator().manual_seed(t * k), t, k, experts)
    r = route_reference(idx, experts)
    flat = idx.reshape(-1)
    keys = [(flat[o].item(), o.item()) for o in r.order]
    assert keys == sorted(keys)
    assert torch.equal(r.position[r.order], torch.arange(flat.numel()))
    assert torch.equal(r.token, r.order // k)
    assert r.offsets[0] == 0 and r.offsets[-1] == flat.numel() and r.offsets.dtype == torch.int32
    for e in range(experts):
        assert torch.all(flat[r.order[r.offsets[e] : r.offsets[e + 1]]] == e)
    assert check_route(route(idx, experts), r)  # off CUDA: the reference


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_route_kernel_under_the_triton_interpreter():
    run_under_interpreter(str(Path(__file__)), marker="interpreter: route matches")


def _interpreter_main() -> None:
    kernels_on_cpu()
    gen = seeded_generator()
    failures = [
        (t, k, experts)
        for t, k, experts in CASES
        if not check_route(route(idx := routing(gen, t, k, experts), experts), route_reference(idx, experts))
    ]
    report("route", failures)


if __name__ == "__main__" and "--interpret" in sys.argv:
    sys.path.insert(0, str(ROOT))
    _interpreter_main()
