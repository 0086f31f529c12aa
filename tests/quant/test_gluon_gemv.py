"""The Gluon FP8 decode kernel, compiled for the H200 (sm_90) on this CPU machine.

Gluon kernels do not run under Triton's interpreter, so their numbers are checked on the GPU
(tests/gpu/test_fp8_gemv.py). What this machine can check is the compiler's output, with Triton's
own compiler and its bundled ptxas / cuobjdump: every variant the tiling or a sweep picks compiles
(a layout conversion that would move data fails `assert_trivial`), the K loop reads codes and
activations with 16-byte global loads and never touches shared memory, and the SASS of its loop
issues the instructions per weight element that make the kernel memory-bound rather than
issue-bound (the Triton kernel's loop: ~7.3 PTX instructions per element, docs/benchmarks.md M4).
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
import tempfile

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("triton.experimental.gluon")

from skyq.rollout.kernels import gluon_fp8_gemv as g  # noqa: E402
from skyq.rollout.kernels import triton_fp8_gemv  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _always_compile():
    """Compile afresh: Triton's on-disk cache has returned a kernel built from an older revision
    of a called function here, which would check stale code."""
    old = os.environ.get("TRITON_ALWAYS_COMPILE")
    os.environ["TRITON_ALWAYS_COMPILE"] = "1"
    yield
    if old is None:
        del os.environ["TRITON_ALWAYS_COMPILE"]
    else:
        os.environ["TRITON_ALWAYS_COMPILE"] = old


@functools.cache
def _compiled(config, **kw):
    return g.compile_offline(config, **kw)


def _sass(kernel) -> str:
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        return subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, check=True).stdout


def _loop_ops(sass: str) -> list[str]:
    """Opcodes of the main K loop: from the target of the last backward branch to that branch."""
    ins = []
    for line in sass.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]+)\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)(.*);", line)
        if m:
            ins.append((int(m.group(1), 16), m.group(2), m.group(3)))
    loops = []
    for addr, op, rest in ins:
        if op == "BRA":
            target = int(rest.split()[0], 16)
            if target < addr:
                loops.append([o.split(".")[0] for a, o, _ in ins if target <= a <= addr])
    assert loops, "no K loop found in the SASS"
    return max(loops, key=len)


# (BM, BN, KC, split, warps, kwarps): the default tiling's families and the sweep's
CONFIGS = [
    (8, 64, 128, 1, 4, 1),
    (16, 64, 128, 4, 4, 1),
    (32, 64, 128, 2, 4, 1),
    (64, 64, 64, 1, 4, 1),
    (16, 128, 128, 1, 8, 1),
    (8, 16, 128, 1, 1, 8),
    (16, 32, 128, 1, 2, 4),
]


@pytest.mark.parametrize("prefetch", [0, 2])
@pytest.mark.parametrize("config", CONFIGS)
def test_the_k_loop_loads_16_byte_vectors_into_the_mma_registers_without_shared_memory(config, prefetch):
    """Per loop iteration (one step, or two with the ping-pong prefetch): one 16-byte load per 16
    codes, the activations' 16-byte vectors and the scale; the MMAs; the dequantization at 3
    instructions per code; and in all at most 4.5 (6.75 at >= 32 batch rows) per code."""
    bm, bn, kc, _split, warps, _kwarps = config
    steps = 2 if prefetch == 2 else 1
    k = _compiled(config, prefetch=prefetch)
    assert "ldmatrix" not in k.asm["ptx"] and "cp.async" not in k.asm["ptx"]
    ops = _loop_ops(_sass(k))
    assert not {"LDS", "STS", "LDSM", "LDGSTS", "BAR"} & set(ops), "the K loop uses shared memory"
    loads = ops.count("LDG")
    per_thread = steps * bn * kc // (32 * warps)  # codes per thread per loop iteration
    x_vectors = bm * kc * 2 // 16 // 32  # 16-byte activation vectors per lane (every warp the whole tile)
    assert loads == per_thread // 16 + steps * (x_vectors + 1)  # + the scale
    assert ops.count("HMMA") == steps * (bn // (16 * warps)) * (kc // 16) * (bm // 8)
    # the dequantization: one e4m3x2 unpack per 2 codes, one widening and one multiply per code,
    # one bf16x2 pack per 2: 3 per weight element; all else (MMA, loads, addressing) on top
    assert ops.count("FMUL") == per_thread and ops.count("HADD2") == per_thread
    assert ops.count("F2FP") == per_thread
    per_element = len(ops) / per_thread
    limit = 4.5 if bm <= 16 else 6.75
    assert per_element <= limit, f"{per_element:.2f} instructions per weight element in the K loop"


@pytest.mark.parametrize("config", CONFIGS)
def test_the_codes_are_loaded_evict_first_and_the_activations_without_a_hint(config):
    """Each code is read once: its 16-byte loads carry the L1 and L2 evict-first policy, so the
    streamed weights do not push the re-read activations out of L2 (on the
    H200 the model's decode step went 1.41 / 1.36 / 1.25 -> 1.49 / 1.44 / 1.32x bf16 at batch
    1 / 8 / 16, docs/benchmarks.md M4); the activation and scale loads carry none."""
    bm, bn, kc, _split, warps, _kwarps = config
    ptx = _compiled(config, prefetch=0).asm["ptx"]  # no prefetch: every load is the loop's
    loads = re.findall(r"ld\.global[.:\w]*", ptx)
    hinted = [op for op in loads if "evict_first" in op]
    assert len(hinted) == bn * kc // (32 * warps) // 16 and all(op.endswith(".v4.b32") for op in hinted)
    assert all("L2::cache_hint" in op for op in hinted)
    plain = [op for op in loads if "evict_first" not in op and ".cg" not in op]  # not the split's partials
    assert plain.count("ld.global.v4.b32") == bm * kc * 2 // 16 // 32 and plain.count("ld.global.b32") == 1
    assert len(plain) == bm * kc * 2 // 16 // 32 + 1


def test_uneven_k_fp32_activations_row_scales_and_prefetch_variants_compile():
    """Each other code path of the kernel compiles to the same conversion-free operand layout."""
    for kw in (
        dict(even_k=False),
        dict(x_dtype="fp32"),
        dict(block_size=(96, 128)),
        dict(prefetch=1),
        dict(prefetch=0),
        dict(block_size=(128, 64)),
    ):
        for kwarps in (1, 4):
            config = (16, 64, 64 if kw.get("block_size") == (128, 64) else 128, 2, 4, kwarps)
            ptx = _compiled(config, **kw).asm["ptx"]
            assert "ldmatrix" not in ptx and "mma.sync.aligned.m16n8k16" in ptx, kw


@pytest.mark.parametrize("m", [1, 2, 5, 8, 9, 16, 17, 31, 33, 64, 100])
@pytest.mark.parametrize(
    ("n", "k"),
    [(5120, 2048), (2048, 4096), (12288, 2048), (2048, 6144), (512, 2048), (64, 128), (768, 2048), (1536, 1024),
     (1024, 384)],
)  # fmt: skip
def test_tiling_gives_launchable_configs(m, n, k):
    bm, bn, kc, split, warps, kwarps = g.tiling(m, n, k, 128, 132)
    assert (bn, warps, kc) == (16, 1, 128)
    steps = -(-k // kc)
    if m > 16:  # row tiles of 8 (<= 32 rows) or 16, 4 K warps where there are >= 2 steps each
        assert (bm, split) == ((8 if m <= 32 else 16), 1)
        assert kwarps == max(w for w in (1, 2, 4) if w == 1 or steps >= 2 * w)
        return
    top = min(64, max(8, 1 << (m - 1).bit_length()))
    split_batch = top == 16 and -(-n // 16) < 1.5 * 132  # 9-16 rows as two 8-row tiles
    assert bm == (8 if split_batch else top)
    tiles = -(-n // bn) * -(-m // bm)
    assert kwarps in (1, 2, 4, 8, 16) and (kwarps == 1 or steps >= 2 * kwarps)
    if kwarps < 16 and steps >= 4 * kwarps:  # stopped by the warp count of the weight tiles
        assert -(-n // bn) * kwarps >= 7.5 * 132
    assert split == 1 or (tiles * split // 2 < 0.5 * 132 and steps >= 2 * kwarps * split)
    k_per_group, split2, even = g.launch_shape(k, kc, split, kwarps)
    assert k_per_group % kc == 0 and split2 <= split and split2 * kwarps * k_per_group >= k


@pytest.mark.parametrize(
    ("n", "k", "expect", "bm16"),
    [(5120, 2048, 4, 16), (2048, 4096, 8, 8), (12288, 2048, 2, 16), (2048, 6144, 8, 8)],
)
def test_tiling_of_the_fused_model_shapes_is_the_sweeps_best(n, k, expect, bm16):
    """The H200 sweeps' best (docs/benchmarks.md, M4): 16-row programs on one warp, no
    split, 4 / 8 / 2 / 8 K warps for q/k/v, o, gate/up and down; at 16 rows o and down (128 weight
    tiles) as two 8-row tiles."""
    for m in (1, 4, 8):
        assert g.tiling(m, n, k, 128, 132) == (8, 16, 128, 1, 1, expect)
    assert g.tiling(16, n, k, 128, 132) == (bm16, 16, 128, 1, 1, expect)


def test_supports_and_applies():
    import torch

    assert g.supports((128, 128)) and g.supports((1, 64)) and g.supports((128, 256))
    assert not g.supports((128, 32)) and not g.supports((128, 96)) and not g.supports((0, 128))
    q = torch.zeros(256, 256, dtype=torch.float8_e4m3fn)
    assert not triton_fp8_gemv._gluon_applies(torch.zeros(1, 256), q, (128, 128))  # not a GPU tensor


@settings(max_examples=300, deadline=None)
@given(
    k=st.integers(1, 20000).map(lambda v: 4 * v),
    kc=st.sampled_from([64, 128]),
    split=st.sampled_from([1, 2, 4, 8, 16]),
    kwarps=st.sampled_from([1, 2, 4, 8, 16]),
)
def test_the_k_groups_cover_every_column_once(k, kc, split, kwarps):
    """Group g of split s takes columns [(s * kwarps + g) * k_per_group, + k_per_group): disjoint,
    in whole KC steps, together covering [0, K); no launched split lies wholly past K (groups of the
    last one may, masked); `even` (no column masks in the kernel) holds exactly when no group
    reaches past K."""
    k_per_group, launched, even = g.launch_shape(k, kc, split, kwarps)
    assert k_per_group % kc == 0 and 1 <= launched <= split
    groups = launched * kwarps
    assert (launched - 1) * kwarps * k_per_group < k  # the last split holds a column
    assert groups * k_per_group >= k  # every column has a group (groups past K are masked)
    assert even == (groups * k_per_group == k)


@pytest.mark.parametrize(
    ("config", "x_dtype", "even_k"),
    [
        ((8, 16, 128, 1, 1, 1), "bf16", True),
        ((16, 16, 128, 1, 1, 2), "bf16", False),
        ((8, 16, 128, 1, 1, 4), "fp32", True),
        ((32, 16, 128, 1, 1, 1), "bf16", True),
        ((32, 16, 128, 1, 1, 4), "bf16", False),
    ],
)
def test_the_grouped_kernel_is_the_decode_loop_per_expert_and_row_tile(config, x_dtype, even_k):
    """`_gemv_grouped_kernel` (MoE experts in one launch) runs the decode kernel's K loop (16-byte
    evict-first code loads into the MMA registers, the next step loaded ahead) inside a loop over
    the expert's row tiles, with no local memory: the same instructions as `_gemv_kernel`'s
    PREFETCH 1 per step."""
    bm, bn, kc, _split, warps, kwarps = config
    ptx = g.compile_grouped_offline(config, x_dtype=x_dtype, even_k=even_k).asm["ptx"]
    single = _compiled(config, x_dtype=x_dtype, even_k=even_k, prefetch=1).asm["ptx"]
    mma = "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"
    assert ptx.count(mma) == single.count(mma) > 0
    assert ptx.count("evict_first") == single.count("evict_first") > 0  # the code loads, masked or not
    assert "ld.local" not in ptx and "st.local" not in ptx


@pytest.mark.parametrize(
    ("tokens", "top_k", "experts", "bm"),
    [(1, 8, 128, 8), (64, 8, 128, 8), (128, 8, 128, 16), (192, 8, 128, 16), (256, 8, 128, 32), (1024, 8, 128, 32),
     (64, 4, 32, 16), (128, 4, 32, 32), (512, 4, 32, 32)],
)  # fmt: skip
def test_grouped_tiling_row_tile_grows_with_the_rows_an_expert(tokens, top_k, experts, bm):
    """The grouped kernel's row tile by the mean rows an expert (H200 sweeps, docs/benchmarks.md):
    8 up to a mean of 6, 16 up to 12, 32 above (the large decode steps)."""
    got = g.grouped_tiling(tokens * top_k, experts, 1536, 2048, 128, 132)
    assert got[0] == bm and got[1:4] == (16, 128, 1)
