"""skyq: declarative low-precision RL post-training for mixture-of-experts LLMs.

Importing this package is lean: it pulls in no GPU backend (vLLM, Megatron-core,
Transformer Engine) and never initialises CUDA.
"""

__version__ = "0.1.0"
