"""trainer=megatron: a megatron-core trainer (Transformer Engine on the GPU, the local spec on the CPU).

Importing this package imports nothing from megatron-core or TE; the submodules do, inside a
Megatron worker process. `config.transformer_config` (skyq configs -> TransformerConfig),
`model.build_model` (the GPTModel of this rank), `fake_int4` (precision=int4_qat's linears),
`cpu_compat.apply` (megatron-core on a CUDA-less torch), `compat` (supported versions).
"""
