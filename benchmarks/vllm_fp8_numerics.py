"""Where the trainer-vs-vLLM FP8 mismatch comes from, on the CPU: one linear, three functions.

- the trainer's FP8 blockwise forward (W8A8 fake quant): activation and weight quantized by skyq's own
  quantizers, each dequantized and rounded to bf16 (`bf16(code x scale)`), then a bf16 GEMM;
- the W8A8 GEMM an engine runs (vLLM's block-FP8 path): codes multiplied, the fp32 scales applied to the
  fp32 partial sums, the output rounded to bf16 (computed exactly here, in float64);
- a bf16 GEMM against the exact product of the same bf16 inputs: the rounding noise of any GEMM.

With fp32 scales `bf16(code x scale)` is inexact, with ue8m0 (power-of-two) scales it is exact, so the
relative difference trainer vs W8A8 shows how much of the mismatch the scale format decides.

    .venv/bin/python benchmarks/vllm_fp8_numerics.py --trials 3
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from skyq.quant import fp8_blockwise
from skyq.quant.fake_quant import fake_quant_fp8_activation, fake_quant_fp8_blockwise


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def dequantized(x: torch.Tensor, block: tuple[int, int], pow2: bool) -> torch.Tensor:
    """`x` [M, K] quantized in `block` tiles and dequantized exactly (float64)."""
    q, scale_inv = fp8_blockwise.quantize(x, block_size=block, pow2_scale=pow2)
    full = scale_inv.double().repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    return q.double() * full[: x.shape[0], : x.shape[1]]


def one_linear(m: int, k: int, n: int, pow2: bool, gen: torch.Generator) -> dict[str, float]:
    # rows of varied magnitude and a few outlier channels, as activations have
    x = torch.randn(m, k, generator=gen) * torch.exp(torch.randn(m, 1, generator=gen))
    x[:, torch.randint(0, k, (8,), generator=gen)] *= 20
    x = x.bfloat16()
    w = torch.randn(n, k, generator=gen) * 0.02
    xd, wd = dequantized(x.float(), (1, 128), pow2), dequantized(w, (128, 128), pow2)
    engine = (xd @ wd.T).float().bfloat16()
    trainer = F.linear(
        fake_quant_fp8_activation(x, 128, pow2), fake_quant_fp8_blockwise(w, (128, 128), pow2).bfloat16()
    )
    bf16_gemm = F.linear(x, w.bfloat16())
    bf16_exact = (x.double() @ w.bfloat16().double().T).float().bfloat16()
    return {
        "trainer_vs_w8a8": relative(trainer, engine),
        "bf16_gemm_noise": relative(bf16_gemm, bf16_exact),
        "activation_rounding": relative(xd.bfloat16(), xd),
        "weight_rounding": relative(wd.bfloat16(), wd),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--shape", type=int, nargs=3, default=[256, 1024, 768], metavar=("M", "K", "N"))
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    print(f"linear {args.shape[0]} x {args.shape[1]} -> {args.shape[2]}, relative differences (norm)")
    print(
        f"{'scales':8} {'trainer vs W8A8':>16} {'bf16 GEMM noise':>16} {'bf16(x) rounding':>17} {'bf16(w) rounding':>17}"
    )
    for trial in range(args.trials):
        for pow2 in (False, True):
            r = one_linear(*args.shape, pow2, gen)
            print(f"{'ue8m0' if pow2 else 'fp32':8} {r['trainer_vs_w8a8']:16.2e} {r['bf16_gemm_noise']:16.2e} "
                  f"{r['activation_rounding']:17.2e} {r['weight_rounding']:17.2e}   (trial {trial})")  # fmt: skip


if __name__ == "__main__":
    main()
