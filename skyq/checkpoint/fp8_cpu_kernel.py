"""A compiled CPU kernel for `fp8_blockwise.quantize` on 2-D BF16 weights, bit-identical to it.

Eager torch makes a pass over memory for each step of blockwise FP8 (a bf16 x fp32 multiply, a clamp
and torch's scalar fp32 -> e4m3 cast, the costliest of them). This kernel does the block max, the
scale and the multiply-clamp-cast of one row of blocks while it sits in cache, in one pass (the
per-element costs of both: docs/benchmarks.md, M6 converters, "The converter code's CPU choices").
The arithmetic is the reference's: fp32 `448 / amax` (FLT_MAX on overflow, 1 for an all-zero
block, mantissa cleared for power-of-two scales), one fp32 multiply, the clamp, and c10's
`fp8e4m3fn_from_fp32_value` rounding, written branch-free so the compiler vectorizes it.

The C source is compiled once per machine with the system C compiler (`cc`) into the user
cache and loaded with ctypes (which releases the GIL during the call). Without a compiler, or on a
weight it does not cover (not BF16, not 2-D, columns not contiguous), the caller uses the
reference; a block with NaN/inf makes the kernel decline so the reference raises its usual error.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

_SOURCE = r"""
#include <float.h>
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

static inline float f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

/* c10::detail::fp8e4m3fn_from_fp32_value of x clamped to [-448, 448] (x is never NaN here). */
static inline uint8_t e4m3_clamped(float x) {
    const uint32_t u = bits(x);
    int32_t a = (int32_t)(u & 0x7FFFFFFFu);
    a = a < 0x43E00000 ? a : 0x43E00000; /* |x| <= 448.0f */
    const int32_t denorm_mask = 141 << 23;
    const int32_t sub = (int32_t)bits(f32((uint32_t)a) + f32((uint32_t)denorm_mask)) - denorm_mask;
    const int32_t nor = (a + ((7 - 127) * (1 << 23)) + 0x7FFFF + ((a >> 20) & 1)) >> 20;
    return (uint8_t)((a < (121 << 23) ? sub : nor) | ((u >> 24) & 0x80u));
}

static void quantize_run(const uint16_t *in, uint8_t *out, int64_t len, float s) {
    for (int64_t j = 0; j < len; j++) out[j] = e4m3_clamped(f32((uint32_t)in[j] << 16) * s);
}

#if defined(__x86_64__)
/* The same arithmetic, 8 lanes at a time, 32 codes per store. */
__attribute__((target("avx2"))) static void quantize_run_avx2(const uint16_t *in, uint8_t *out, int64_t len,
                                                              float s) {
    const __m256 scale = _mm256_set1_ps(s);
    const __m256i magnitude = _mm256_set1_epi32(0x7FFFFFFF), max448 = _mm256_set1_epi32(0x43E00000);
    const __m256i denorm = _mm256_set1_epi32(141 << 23), min_normal = _mm256_set1_epi32(121 << 23);
    const __m256i bias = _mm256_set1_epi32((7 - 127) * (1 << 23) + 0x7FFFF);
    const __m256i one = _mm256_set1_epi32(1), sign_bit = _mm256_set1_epi32(0x80);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    int64_t j = 0;
    for (; j + 32 <= len; j += 32) {
        __m256i r[4];
        for (int v = 0; v < 4; v++) {
            const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(in + j + 8 * v)));
            const __m256i u = _mm256_castps_si256(_mm256_mul_ps(_mm256_castsi256_ps(_mm256_slli_epi32(h, 16)), scale));
            const __m256i a = _mm256_min_epi32(_mm256_and_si256(u, magnitude), max448);
            const __m256i sub = _mm256_sub_epi32(
                _mm256_castps_si256(_mm256_add_ps(_mm256_castsi256_ps(a), _mm256_castsi256_ps(denorm))), denorm);
            const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(a, 20), one);
            const __m256i nor = _mm256_srai_epi32(_mm256_add_epi32(_mm256_add_epi32(a, bias), odd), 20);
            const __m256i code = _mm256_blendv_epi8(nor, sub, _mm256_cmpgt_epi32(min_normal, a));
            r[v] = _mm256_or_si256(code, _mm256_and_si256(_mm256_srli_epi32(u, 24), sign_bit));
        }
        /* codes are 0..255: two saturating packs keep them, the permute undoes the lane interleave */
        const __m256i bytes = _mm256_packus_epi16(_mm256_packus_epi32(r[0], r[1]), _mm256_packus_epi32(r[2], r[3]));
        _mm256_storeu_si256((__m256i *)(out + j), _mm256_permutevar8x32_epi32(bytes, order));
    }
    quantize_run(in + j, out + j, len - j, s);
}
#endif

/* w: bf16 [n, k], row stride rs elements; q: e4m3 [n, k] contiguous; sinv: fp32 [ceil(n/bn), ceil(k/bk)].
   One bn x bk block at a time: its max, its scale, then its codes while the block is still in L1.
   Returns 1 (and stops) at a block holding NaN or inf. */
int skyq_fp8_blockwise_bf16(const uint16_t *w, int64_t n, int64_t k, int64_t rs, int64_t bn, int64_t bk,
                            int pow2, uint8_t *q, float *sinv) {
    void (*run)(const uint16_t *, uint8_t *, int64_t, float) = quantize_run;
#if defined(__x86_64__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2")) run = quantize_run_avx2;
#endif
    const int64_t nbc = (k + bk - 1) / bk;
    for (int64_t r0 = 0; r0 < n; r0 += bn) {
        const int64_t r1 = r0 + bn < n ? r0 + bn : n;
        for (int64_t c = 0; c < nbc; c++) {
            const int64_t j0 = c * bk, len = (j0 + bk < k ? j0 + bk : k) - j0;
            uint16_t m = 0;
            for (int64_t r = r0; r < r1; r++) {
                const uint16_t *in = w + r * rs + j0;
                for (int64_t j = 0; j < len; j++) {
                    const uint16_t v = in[j] & 0x7FFFu;
                    m = v > m ? v : m;
                }
            }
            if (m >= 0x7F80u) return 1;
            const float a = f32((uint32_t)m << 16);
            float s = 448.0f / a;
            if (s > FLT_MAX) s = FLT_MAX;
            if (a == 0.0f) s = 1.0f;
            if (pow2) s = f32(bits(s) & 0x7F800000u);
            sinv[(r0 / bn) * nbc + c] = 1.0f / s;
            for (int64_t r = r0; r < r1; r++) run(w + r * rs + j0, q + r * k + j0, len, s);
        }
    }
    return 0;
}
"""

# No -ffast-math: the kernel relies on IEEE fp32 division, multiplication and rounding.
_FLAGS = ["-O3", "-fPIC", "-shared", "-fno-fast-math", "-ffp-contract=off", "-fno-trapping-math"]


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "skyq"


def _build(compiler: str, target: Path) -> None:
    """Compile into a temp file next to `target`, then rename: concurrent builds never see half a file."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        src = Path(tmp) / "fp8_blockwise.c"
        src.write_text(_SOURCE)
        out = Path(tmp) / target.name
        subprocess.run(
            [compiler, *_FLAGS, str(src), "-o", str(out)], check=True, capture_output=True, timeout=120
        )
        os.replace(out, target)


@functools.cache
def _library() -> ctypes.CDLL | None:
    """The compiled kernel, built on first use; None where it cannot be built or loaded."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return None
    key = hashlib.sha256("\0".join([_SOURCE, *_FLAGS, compiler, platform.machine()]).encode()).hexdigest()[
        :16
    ]
    for directory in (_cache_dir(), Path(tempfile.gettempdir()) / f"skyq-{os.getuid()}"):
        target = directory / f"fp8_blockwise_{key}.so"
        try:
            if not target.exists():
                _build(compiler, target)
            lib = ctypes.CDLL(str(target))
        except (OSError, subprocess.SubprocessError):
            continue
        fn = lib.skyq_fp8_blockwise_bf16
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p] + [ctypes.c_int64] * 5 + [ctypes.c_int] + [ctypes.c_void_p] * 2
        return lib
    return None


def available() -> bool:
    """True when the kernel is built (or can be) on this machine."""
    return _library() is not None


def covers(w: torch.Tensor) -> bool:
    """Whether the kernel handles `w`: a 2-D BF16 CPU tensor with contiguous rows."""
    return (
        w.device.type == "cpu"
        and w.dtype == torch.bfloat16
        and w.ndim == 2
        and w.numel() > 0
        and w.stride(1) == 1
    )


def quantize_blockwise(
    w: torch.Tensor, *, block_size: tuple[int, int], pow2_scale: bool
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`fp8_blockwise.quantize(w, block_size=..., pow2_scale=...)`, bit for bit, or None when the
    kernel is unavailable, does not cover `w`, or `w` holds NaN/inf (the reference then raises)."""
    lib = _library()
    if lib is None or not covers(w):
        return None
    (n, k), (bn, bk) = w.shape, block_size
    nbr, nbc = -(-n // bn), -(-k // bk)
    q = torch.empty((n, k), dtype=torch.float8_e4m3fn)
    scale_inv = torch.empty((nbr, nbc), dtype=torch.float32)
    status = lib.skyq_fp8_blockwise_bf16(
        w.data_ptr(), n, k, w.stride(0), bn, bk, int(pow2_scale),
        q.data_ptr(), scale_inv.data_ptr(),
    )  # fmt: skip
    return None if status else (q, scale_inv)
