"""The Gluon weight-only decode kernels (`gluon_wo_gemv`: INT4, MXFP8), compiled for the H200 (sm_90)
on this CPU machine: the tiling rules pick the H200 sweeps' tiles, and every tiling compiles with the
weight and activation operands reaching the MMA layout without data movement (`assert_trivial`), the
K loop holds no shared-memory access when one warp group takes the K range, and each word's
dequantization is the expected PTX (INT4: 4 instructions a pair; MXFP8: the FP8 kernel's e4m3
conversion). Their numbers need a GPU (tests/gpu/test_gluon_wo_gpu.py)."""

from __future__ import annotations

import pytest

pytest.importorskip("triton.experimental.gluon")

from skyq.rollout.kernels import gluon_wo_gemv as g  # noqa: E402
from tests.quant.test_gluon_gemv import _always_compile  # noqa: E402, F401  (TRITON_ALWAYS_COMPILE=1)


@pytest.mark.parametrize(
    ("m", "n", "k", "config"),
    [(1, 5120, 2048, (8, 16, 128, 1, 1, 4)), (1, 12288, 2048, (8, 32, 128, 1, 1, 4)),
     (16, 12288, 2048, (16, 16, 128, 1, 1, 2)), (16, 2048, 6144, (16, 16, 128, 1, 1, 8)),
     (32, 2048, 4096, (32, 16, 128, 1, 1, 8)), (64, 12288, 2048, (32, 32, 128, 1, 1, 1)),
     (64, 5120, 2048, (32, 16, 128, 1, 1, 1)), (1, 256, 16384, (8, 16, 128, 4, 1, 16))],
)  # fmt: skip
def test_the_dense_tiling_picks_the_sweeps_tiles(m, n, k, config):
    """Cells of the session-21 H200 sweep (docs/benchmarks.md); a small weight splits K."""
    assert g.tiling(m, n, k, 132) == config


@pytest.mark.parametrize(
    ("rows", "experts", "n", "k", "config"),
    [(8, 128, 1536, 2048, (8, 32, 128, 1, 1, 4)), (512, 128, 1536, 2048, (8, 32, 128, 1, 1, 1)),
     (2048, 128, 2048, 768, (32, 32, 128, 1, 1, 1)), (256, 32, 1536, 1024, (16, 32, 128, 1, 1, 1)),
     (32, 32, 1024, 768, (8, 32, 128, 1, 1, 2))],
)  # fmt: skip
def test_the_grouped_tiling_picks_the_sweeps_tiles(rows, experts, n, k, config):
    assert g.grouped_tiling(rows, experts, n, k, 132) == config


@pytest.mark.parametrize(
    ("m", "n", "k"),
    [(1, 5120, 2048), (16, 2048, 4096), (64, 1536, 1024), (1, 12288, 2048), (64, 12288, 2048)],
)
@pytest.mark.parametrize("even_k", [True, False])
def test_the_tilings_compile_to_trivial_operand_layouts(m, n, k, even_k):
    config = g.tiling(m, n, k, 132)
    ptx = g.compile_offline(config, even_k=even_k).asm["ptx"]
    bm, bn, kc, _split, warps, kwarps = config
    words_per_thread_step = (
        (bn // (16 * warps)) * 2 * (kc // 64) * 2
    )  # row groups x (g, g+8) x chunks x 2 words
    assert ptx.count("sub.rn.bf16x2") == 2 * 4 * words_per_thread_step  # loop body + last step, 4 a word
    assert ptx.count("mma.sync") > 0
    if kwarps == 1:
        assert "ld.shared" not in ptx and "st.shared" not in ptx


@pytest.mark.parametrize("config", [(8, 32, 128, 1, 1, 4), (16, 32, 128, 1, 1, 1), (32, 32, 128, 1, 1, 1)])
def test_the_grouped_tilings_compile(config):
    ptx = g.compile_offline(config, grouped=True).asm["ptx"]
    assert "mma.sync" in ptx and "mul.rn.bf16x2" in ptx


@pytest.mark.parametrize(
    ("m", "n", "k"), [(1, 5120, 2048), (16, 2048, 4096), (64, 12288, 2048), (8, 1536, 288)]
)
@pytest.mark.parametrize("even_k", [True, False])
def test_the_mxfp8_tilings_compile_to_trivial_operand_layouts(m, n, k, even_k):
    """MXFP8: words of four e4m3 codes, each converted by `cvt.rn.f16x2.e4m3x2` twice (the FP8 Gluon
    kernel's `_DEQUANT4`, scales multiplied in fp32), no shared memory in the K loop."""
    config = g.tiling(m, n, k, 132)
    ptx = g.compile_offline(config, even_k=even_k, mx=True).asm["ptx"]
    bm, bn, kc, _split, warps, kwarps = config
    words_per_thread_step = (bn // (16 * warps)) * 2 * (kc // 64) * 4  # row groups x (g, g+8) x chunks x 4
    assert ptx.count("cvt.rn.f16x2.e4m3x2") == 2 * 2 * words_per_thread_step  # loop body + last step
    assert ptx.count("mul.rn.f32") == 2 * 4 * words_per_thread_step
    assert "mma.sync" in ptx and "sub.rn.bf16x2" not in ptx
    if kwarps == 1:
        assert "ld.shared" not in ptx and "st.shared" not in ptx


def test_the_grouped_mxfp8_kernel_compiles():
    ptx = g.compile_offline((32, 32, 128, 1, 1, 1), grouped=True, mx=True).asm["ptx"]
    assert "mma.sync" in ptx and "cvt.rn.f16x2.e4m3x2" in ptx


@pytest.mark.parametrize(
    ("m", "n", "k", "config"),
    [(1, 12288, 2048, (8, 16, 128, 1, 1, 2)), (32, 12288, 2048, (32, 32, 128, 1, 1, 2)),
     (16, 2048, 6144, (16, 16, 128, 1, 1, 8))],
)  # fmt: skip
def test_the_mxfp8_dense_tiling_picks_the_sweeps_tiles(m, n, k, config):
    """MXFP8 cells of the session-21 H200 sweep: 16 weight rows a warp at <= 16 rows."""
    assert g.tiling(m, n, k, 132, mx=True) == config


@pytest.mark.parametrize(
    ("rows", "experts", "n", "k", "config"),
    [(8, 128, 1536, 2048, (8, 32, 128, 1, 2, 2)), (512, 128, 1536, 2048, (8, 32, 128, 1, 2, 1)),
     (2048, 128, 2048, 768, (32, 32, 128, 1, 1, 1))],
)  # fmt: skip
def test_the_mxfp8_grouped_tiling_picks_the_sweeps_tiles(rows, experts, n, k, config):
    assert g.grouped_tiling(rows, experts, n, k, 132, mx=True) == config
