"""Fast GPU paths for the skyq.quant formats, bit-identical to the torch references.

`dispatch` is the entry point: each function there runs a Triton kernel when its input is a CUDA
tensor and Triton imports, and the reference function otherwise, so callers never choose. The
`triton_*` modules import Triton at their top and are imported only by `dispatch`, lazily: this
package imports nothing itself, so `import skyq.quant.kernels` works on machines without Triton.
"""
