"""Reference quantizers: one torch function per on-disk format (see FORMATS.md).

- `fp8_blockwise` — e4m3 with per-block fp32 scales (DeepSeek-V3 layout, TE arithmetic)
- `mxfp8` — e4m3 with per-1x32 E8M0 exponents (TE's round-up rule)
- `int4` — W4A16 symmetric groups, compressed-tensors `pack-quantized`
- `fake_quant` — straight-through autograd wrappers around the above
- `errors` — `QuantizationError` and input checks
- `plan`, `layouts`, `strategies` — the per-parameter plan: which tensor becomes what on the wire;
  pure Python (`dtype_names`), torch imported only by the methods that handle tensors

Submodules are imported explicitly (`from skyq.quant import fp8_blockwise`); this package
imports nothing itself.
"""
