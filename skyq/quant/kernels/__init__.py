"""Fast GPU paths for the skyq.quant formats, bit-identical to the torch references.

`dispatch` is the entry point: each function there runs a Triton kernel when its input is a CUDA
tensor and Triton imports, and the reference function otherwise, so callers never choose. The
`triton_*` modules import Triton at their top and are imported lazily (by `dispatch`, the trainer's
FP8 linear and the weight sync's scan): this package imports nothing itself, so `import
skyq.quant.kernels` works on machines without Triton. The engine's decode kernels, which read what
these quantizers write, live in `skyq.rollout.kernels`.
"""
