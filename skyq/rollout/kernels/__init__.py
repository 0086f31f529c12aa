"""The embedded engine's decode kernels: weight-only GEMVs (FP8 blockwise, INT4, MXFP8) and the FP8 x
FP8 linear, dense and grouped over MoE experts.

`fp8_linear` and `int4_mxfp8_linear` are the entry points the engine calls: each function runs its
Triton/Gluon kernel on CUDA when Triton imports and its torch reference elsewhere. The kernel modules
import Triton at their top and are imported lazily by those two, so this package imports nothing
itself and `import skyq.rollout.kernels` works on machines without Triton. The quantizers these
linears read the output of live in `skyq.quant.kernels`.
"""
