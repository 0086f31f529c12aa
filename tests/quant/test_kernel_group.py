"""The grouped FP8 blockwise, MXFP8 and INT4 quantize kernels (`launch_quantize_group`: one launch for
many tensors) give the bits of the per-tensor kernels for each, checked under the Triton
interpreter where Triton is importable (skipped where Triton is not installed; a subprocess, since
TRITON_INTERPRET must be set before `@triton.jit` runs). On the GPU it is checked against the
reference in tests/gpu/test_quant_kernels.py; without CUDA `dispatch.quantize_fp8_blockwise_group`
is the per-tensor reference, checked in tests/quant/test_strategies.py."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton (not installed in CI)")
def test_the_grouped_kernel_gives_the_per_tensor_kernels_bits_under_the_interpreter():
    from interpreter_run import run_under_interpreter

    run_under_interpreter(__file__)


def _interpreter_check() -> None:
    from skyq.quant.kernels import triton_fp8_blockwise as kernels

    seed = int.from_bytes(os.urandom(4), "little")
    print(f"seed {seed}")
    gen = torch.Generator().manual_seed(seed)
    ws = [
        torch.randn(3, 130, 250, generator=gen).to(torch.bfloat16),
        torch.randn(256, 128, generator=gen).to(torch.bfloat16) * 1e3,
        torch.randn(128, 384, generator=gen).to(torch.bfloat16).t(),  # transposed
        torch.randn(7, 600, generator=gen).to(torch.bfloat16)[:, ::2],  # strided
        torch.randn(1, 1, generator=gen).to(torch.bfloat16),
    ]
    ws[3][2, 5] = float("inf")
    for pow2 in (False, True):
        qs, ss, flags = kernels.launch_quantize_group(ws, block_size=(128, 128), pow2_scale=pow2)
        assert flags.tolist() == [0, 0, 0, 1, 0], flags
        for i, w in enumerate(ws):
            q, s, flag = kernels.launch_quantize(w, block_size=(128, 128), pow2_scale=pow2)
            assert int(flag) == (i == 3)
            if i != 3:
                assert torch.equal(qs[i].view(torch.uint8), q.view(torch.uint8)), i
                assert torch.equal(ss[i], s), i
    # K-contiguous, 16-byte rows, K a multiple of 16: the vectorized (ALIGNED) path.
    aligned = [
        torch.randn(2, 136, 272, generator=gen).to(torch.bfloat16),
        torch.randn(130, 16, generator=gen),
    ]
    for group in (aligned[:1], aligned[1:]):
        qs, ss, flags = kernels.launch_quantize_group(group, block_size=(128, 128), pow2_scale=False)
        for w, gq, gs in zip(group, qs, ss):
            q, s, _ = kernels.launch_quantize(w, block_size=(128, 128), pow2_scale=False)
            assert torch.equal(gq.view(torch.uint8), q.view(torch.uint8)) and torch.equal(gs, s)
    _into_check(
        kernels.launch_quantize_group, aligned + ws[:3], dict(block_size=(128, 128), pow2_scale=False)
    )
    _mxfp8_check(gen)
    _int4_check(gen)
    print("interpreter check passed")


def _into_check(launch, group, kwargs) -> None:
    """`out=`: the same bits written into given tensors (a weight sync's bucket bytes: views at
    16-byte aligned offsets of one uint8 buffer), nothing written outside them."""
    qs, ss, _ = launch(group, **kwargs)
    sizes = [n for q, s in zip(qs, ss) for n in (q.numel() * q.element_size(), s.numel() * s.element_size())]
    offsets, pos = [], 16
    for n in sizes:
        offsets.append(pos)
        pos += (n + 31) // 16 * 16  # at least 16 bytes of gap after each
    buf = torch.full((pos,), 0x5A, dtype=torch.uint8)
    views = [
        buf[o : o + n].view(t.dtype).view(t.shape)
        for o, n, t in zip(offsets, sizes, (t for pair in zip(qs, ss) for t in pair))
    ]
    out = list(zip(views[0::2], views[1::2]))
    launch(group, out=out, **kwargs)
    for (q, s), (gq, gs) in zip(zip(qs, ss), out):
        assert torch.equal(gq.view(torch.uint8), q.view(torch.uint8)) and torch.equal(
            gs.view(torch.uint8), s.view(torch.uint8)
        )
    mask = torch.ones(pos, dtype=torch.bool)
    for o, n in zip(offsets, sizes):
        mask[o : o + n] = False
    assert bool((buf[mask] == 0x5A).all()), "the kernel wrote outside its outputs"


def _mxfp8_check(gen: torch.Generator) -> None:
    from skyq.quant.kernels import triton_mxfp8 as kernels

    ws = [
        torch.randn(3, 20, 96, generator=gen).to(torch.bfloat16),
        torch.randn(64, 40, generator=gen).to(torch.bfloat16).t() * 1e-3,  # transposed: the strided path
        torch.randn(17, 544, generator=gen).to(torch.bfloat16),
    ]
    ws[2][4, 100] = float("nan")
    for group in (ws, [ws[0], ws[2]]):  # with a strided member, then the aligned (vectorized) path
        qs, ss, flags = kernels.launch_quantize_group(group)
        for i, w in enumerate(group):
            q, s, flag = kernels.launch_quantize(w)
            assert int(flags[i]) == int(flag), (i, flags)
            if not int(flag):
                assert torch.equal(qs[i].view(torch.uint8), q.view(torch.uint8)) and torch.equal(ss[i], s), i
        assert int(flags[-1]) == 1
    _into_check(kernels.launch_quantize_group, ws[:2], {})


def _int4_check(gen: torch.Generator) -> None:
    from skyq.quant.kernels import triton_int4 as kernels

    ws = [
        torch.randn(2, 20, 256, generator=gen).to(torch.bfloat16),
        torch.randn(96, 24, generator=gen).to(torch.bfloat16).t() * 1e-3,  # transposed: the strided path
        torch.randn(9, 320, generator=gen),  # fp32: a tile's last groups past K
        torch.randn(40, 128, generator=gen).to(torch.bfloat16),
    ]
    ws[0][1, 3, 7] = float("inf")
    groups = (ws[1:3], [ws[2], ws[0]], [ws[3], ws[0]])
    for grid in ("kimi", "rtn"):
        # a strided member, then the aligned (vectorized) path in fp32 and in bf16, the inf second;
        # the rtn grid (other constants, the same code) on the first group only: the interpreter's
        # reduce with a combine function runs in Python, this check's cost
        for group in groups if grid == "kimi" else groups[:1]:
            group = [w.to(group[0].dtype) for w in group]  # one input dtype per launch
            packs, scales, flags = kernels.launch_quantize_group(group, group_size=32, grid=grid)
            for i, w in enumerate(group):
                _, p, s, flag = kernels.launch_quantize(w, group_size=32, grid=grid, codes=False, packed=True)
                assert int(flags[i]) == int(flag), (i, flags)
                if not int(flag):
                    assert torch.equal(packs[i], p) and torch.equal(
                        scales[i].view(torch.int16), s.view(torch.int16)
                    )
    assert int(kernels.launch_quantize_group(ws[:1], group_size=32, grid="kimi")[2][0]) == 1
    _into_check(kernels.launch_quantize_group, ws[1:3], dict(group_size=32, grid="kimi"))


if __name__ == "__main__" and sys.argv[1:] == ["--interpret"]:
    _interpreter_check()
