"""skyq.quant.kernels.dispatch off the GPU: it takes the reference path and gives its bits, and
(where Triton is installed, not in CI) the kernels run under Triton's CPU interpreter and give
the reference's bits on small shapes.

The interpreter check runs this file as a script in a subprocess, because TRITON_INTERPRET must
be set before the first `@triton.jit` is evaluated.
"""

from __future__ import annotations

import importlib.util
import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from skyq.quant import fp8_blockwise, int4, mxfp8
from skyq.quant.errors import QuantizationError
from skyq.quant.kernels import dispatch

ROOT = Path(__file__).resolve().parents[2]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[a.element_size()]
    return bool((a.contiguous().view(as_int) == b.contiguous().view(as_int)).all())


def _weight(
    gen: torch.Generator, shape: tuple[int, ...], dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    return (
        torch.randn(shape, generator=gen) * 10.0 ** (torch.rand((*shape[:-1], 1), generator=gen) * 6 - 3)
    ).to(dtype)


@pytest.fixture
def gen() -> torch.Generator:
    seed = int(os.environ.get("SKYQ_TEST_SEED", secrets.randbits(32)))
    print(f"SKYQ_TEST_SEED={seed}")
    return torch.Generator().manual_seed(seed)


def test_cpu_tensors_take_the_reference_path():
    assert not dispatch.uses_kernel(torch.zeros(2, 2))


def test_dispatch_gives_the_reference_bits_on_cpu(gen):
    w = _weight(gen, (130, 256))
    for block in ((128, 128), (1, 128), (3, 5)):
        for got, ref in zip(
            dispatch.quantize_fp8_blockwise(w, block_size=block), fp8_blockwise.quantize(w, block_size=block)
        ):
            assert _same(got, ref)
    q, s = fp8_blockwise.quantize(w)
    assert _same(dispatch.dequantize_fp8_blockwise(q, s), fp8_blockwise.dequantize(q, s))
    assert all(
        _same(a, b) for a, b in zip(dispatch.quantize_fp8_activation(w), fp8_blockwise.quantize_activation(w))
    )
    assert all(_same(a, b) for a, b in zip(dispatch.quantize_mxfp8(w), mxfp8.quantize(w)))
    qm, sm = mxfp8.quantize(w)
    assert _same(dispatch.dequantize_mxfp8(qm, sm), mxfp8.dequantize(qm, sm))
    codes, scale = int4.quantize(w, group_size=32, grid="rtn")
    assert all(
        _same(a, b) for a, b in zip(dispatch.quantize_int4(w, group_size=32, grid="rtn"), (codes, scale))
    )
    packed, scale_p = dispatch.quantize_int4_packed(w, group_size=32, grid="rtn")
    assert _same(packed, int4.pack(codes)) and _same(scale_p, scale)
    assert _same(
        dispatch.dequantize_int4_packed(packed, scale, [130, 256]),
        int4.dequantize_packed(packed, scale, [130, 256]),
    )


def test_dispatch_raises_the_reference_errors_on_cpu():
    w = torch.ones(4, 64)
    w[1, 2] = float("nan")
    with pytest.raises(QuantizationError, match="layer: 1 NaN"):
        dispatch.quantize_fp8_blockwise(w, name="layer")
    with pytest.raises(QuantizationError, match="K % 32 == 0"):
        dispatch.quantize_mxfp8(torch.ones(4, 40))


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_kernels_match_the_reference_under_the_triton_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, __file__], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600
    )
    assert out.returncode == 0 and "interpreter: all kernels match" in out.stdout, out.stdout + out.stderr


# --- the script the interpreter test runs -------------------------------------------------------


def _exact_interpreter_casts() -> None:
    """Triton 3.6's interpreter casts fp32 to e4m3/bf16 with a hand-written rounding that neither
    carries into the exponent nor breaks ties to even (126.2 -> e4m3 gives 64, not 128). The GPU
    uses the hardware's round-to-nearest-even casts; give the interpreter torch's, which match.
    Its fma also rounds twice (the GPU's rounds once), and a runtime loop bound fails under NumPy 2."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    torch_of = {
        tl.float32: torch.float32,
        tl.float16: torch.float16,
        tl.bfloat16: torch.bfloat16,
        tl.float8e4nv: torch.float8_e4m3fn,
        tl.float64: torch.float64,
    }
    bits_of = {
        8: (np.uint8, torch.uint8),
        16: (np.uint16, torch.int16),
        32: (np.uint32, torch.int32),
        64: (np.uint64, torch.int64),
    }
    inexact = interpreter._convert_float

    def convert(data, src, dst, rounding_mode):
        if src not in torch_of or dst not in torch_of:
            return inexact(data, src, dst, rounding_mode)
        raw = torch.from_numpy(np.ascontiguousarray(data).view(np.uint8).copy()).view(torch_of[src])
        np_bits, torch_bits = bits_of[dst.primitive_bitwidth]
        return raw.to(torch_of[dst]).view(torch_bits).numpy().view(np_bits).reshape(data.shape)

    interpreter._convert_float = convert

    def fma(self, x, y, z):  # numpy's x * y + z rounds twice; the GPU's fma once (float64 is exact here)
        exact = x.data.astype(np.float64) * y.data.astype(np.float64) + z.data.astype(np.float64)
        return interpreter.TensorHandle(exact.astype(x.data.dtype), z.dtype.scalar)

    interpreter.InterpreterBuilder.create_fma = fma

    patch_tensor = interpreter._patch_lang_tensor

    def patch_with_index(tensor, scope):  # int() of a 1-element array fails under NumPy 2
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patch_with_index


def _interpreter_main() -> None:
    from tests.interpreter_run import seeded_generator

    _exact_interpreter_casts()
    from skyq.quant.kernels import triton_fp8_act, triton_fp8_blockwise, triton_int4, triton_mxfp8

    gen = seeded_generator()
    failures = []

    def check(label: str, got: torch.Tensor, ref: torch.Tensor) -> None:
        if not _same(got, ref):
            failures.append(label)

    w = _weight(gen, (200, 300))
    for block in ((128, 128), (1, 128), (64, 32)):
        for pow2 in (False, True):
            q, s = triton_fp8_blockwise.quantize(w, block_size=block, pow2_scale=pow2)
            q_ref, s_ref = fp8_blockwise.quantize(w, block_size=block, pow2_scale=pow2)
            check(f"fp8 {block} pow2={pow2} q", q, q_ref)
            check(f"fp8 {block} pow2={pow2} s", s, s_ref)
            fake = triton_fp8_blockwise.fake_quantize(w, block_size=block, pow2_scale=pow2)
            check(
                f"fp8 fake {block} pow2={pow2}",
                fake,
                fp8_blockwise._dequantize(q_ref, s_ref, *block, w.dtype),
            )
        check(
            f"fp8 dequant {block}",
            triton_fp8_blockwise.dequantize(q_ref, s_ref, block_size=block),
            fp8_blockwise.dequantize(q_ref, s_ref, block_size=block),
        )
    bands = (1, 40, 520)  # 1 x 128 tiles in each row band (`SMALL_ROW_BANDS`: 1 row, 4 rows, wide)
    assert [triton_fp8_blockwise.small_row_band(rows)[0] for rows in bands] == [1, 4, 0]
    for rows in bands:
        xa = _weight(gen, (rows, 300))
        q_ref, s_ref = fp8_blockwise.quantize_activation(xa)
        for got, ref, part in zip(
            triton_fp8_blockwise.quantize(xa, block_size=(1, 128)), (q_ref, s_ref), "qs"
        ):
            check(f"fp8 activation {rows} rows {part}", got, ref)
        fake = triton_fp8_blockwise.fake_quantize(xa, block_size=(1, 128))
        check(
            f"fp8 fake activation {rows} rows",
            fake,
            fp8_blockwise._dequantize(q_ref, s_ref, 1, 128, xa.dtype),
        )
    for block in ((256, 64),):  # a block taller than the row slice: the two-pass (sliced) path, fake quant
        q_ref, s_ref = fp8_blockwise.quantize(w, block_size=block)
        q, s = triton_fp8_blockwise.quantize(w, block_size=block)
        check(f"fp8 sliced {block} q", q, q_ref)
        fake = triton_fp8_blockwise.fake_quantize(w, block_size=block)
        check(f"fp8 fake sliced {block}", fake, fp8_blockwise._dequantize(q_ref, s_ref, *block, w.dtype))
    w3 = _weight(gen, (2, 256, 130), torch.float32).transpose(-1, -2)
    for got, ref, part in zip(triton_fp8_blockwise.quantize(w3), fp8_blockwise.quantize(w3), "qs"):
        check(f"fp8 3-D transposed {part}", got, ref)
    for k, pad in ((256, False), (100, True)):
        wm = _weight(gen, (40, k))
        q, s = triton_mxfp8.quantize(wm, allow_pad=pad)
        q_ref, s_ref = mxfp8.quantize(wm, allow_pad=pad)
        check(f"mxfp8 K={k} q", q, q_ref)
        check(f"mxfp8 K={k} s", s, s_ref)
        check(f"mxfp8 K={k} dequant", triton_mxfp8.dequantize(q_ref, s_ref), mxfp8.dequantize(q_ref, s_ref))
    for shape in ((40, 256), (3, 17, 96), (1, 4096)):  # one pass: quantize and dequantize in registers
        for dtype in (torch.bfloat16, torch.float32):
            wm = _weight(gen, shape, dtype)
            check(
                f"mxfp8 fake {shape} {dtype}",
                triton_mxfp8.fake_quantize(wm),
                mxfp8._dequantize(*mxfp8.quantize(wm), dtype),
            )
    for g, grid in ((32, "kimi"), (128, "rtn")):
        wi = _weight(gen, (24, 512))
        codes, packed, scale = triton_int4.quantize(wi, group_size=g, grid=grid, codes=True, packed=True)
        codes_ref, scale_ref = int4.quantize(wi, group_size=g, grid=grid)
        check(f"int4 g{g} codes", codes, codes_ref)
        check(f"int4 g{g} packed", packed, int4.pack(codes_ref))
        check(f"int4 g{g} scale", scale, scale_ref)
        deq = triton_int4.dequantize_packed(packed, scale, 24, 512, g, torch.bfloat16)
        check(f"int4 g{g} dequant", deq, int4.dequantize_packed(packed, scale, [24, 512]))
    xp = F.pad(_weight(gen, (200, 384)), (0, 0, 0, 56))  # the kernels pad M to 256: codes 0, scale 1
    x = xp[:200]
    q_ref, s_ref = fp8_blockwise.quantize_activation(xp)
    qt_ref, st_ref = fp8_blockwise.quantize_activation(xp.t())
    qr, sr = triton_fp8_act.quantize_rows(x)
    check("activation rows-only q", qr, q_ref)
    check("activation rows-only s", sr.contiguous(), s_ref)
    for sub in (16, 128):  # sliced sweeps, and the whole tile from one load
        q, s, qt, st = triton_fp8_act.quantize_rows_cols(x, sub=sub)
        for label, got, ref in (
            ("rows q", q, q_ref),
            ("rows s", s.contiguous(), s_ref),
            ("cols q", qt, qt_ref),
            ("cols s", st.contiguous(), st_ref),
        ):
            check(f"activation sub {sub} {label}", got, ref)
    wl = _weight(gen, (300, 768))
    q, s_fwd, qt, s_bwd = triton_fp8_act.quantize_weight(wl)
    q_ref, s_ref = fp8_blockwise.quantize(wl)
    check("weight q", q, q_ref)
    check("weight qt", qt, q_ref.t().contiguous())
    check("weight scale fwd", s_fwd[:6].t().contiguous(), s_ref)
    check("weight scale bwd", s_bwd[:3].contiguous(), s_ref)
    if failures:
        sys.exit("interpreter mismatches: " + ", ".join(failures))
    print("interpreter: all kernels match")


if __name__ == "__main__":
    _interpreter_main()


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_two_orientation_kernel_takes_m_and_k_tiles_as_runtime_values():
    """With Triton 3.6, M == 1 and one K tile specialized as constants gave wrong row codes on the
    H200 at 4 and 16 warps (docs/benchmarks.md M3, session 10); the kernel keeps both runtime values
    (the GPU tests check the whole tile's bits at 4, 8 and 16 warps, M = 1 included)."""
    from skyq.quant.kernels import triton_fp8_act

    params = {p.name: p for p in triton_fp8_act._rows_cols_kernel.params}
    assert params["M"].do_not_specialize and params["n_tiles_k"].do_not_specialize
    assert not params["K"].do_not_specialize  # K stays specialized (divisibility: vector loads)
