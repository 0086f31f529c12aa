"""The vLLM rollout backend: a vLLM engine fed through skyq's accounted weight sync.

Nothing here imports vLLM at package import time: `import skyq` stays light, and vLLM (a separate
environment, `scripts/setup_vllm.sh`) is imported only by the modules that drive it. `compat` is the
one module that knows vLLM versions; `transfer` is the skyq weight-transfer backend vLLM's workers run;
`engine.VllmEngine` is what the run loop drives.
"""
