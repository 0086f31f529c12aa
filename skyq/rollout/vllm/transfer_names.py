"""Names vLLM is given to find skyq's code in its workers (import-free, so engine arguments can be
built without vLLM)."""

BACKEND = "skyq"
"""The weight-transfer backend's registry name (`WeightTransferConfig(backend=BACKEND)`)."""

EXTENSION = "skyq.rollout.vllm.worker_ext.SkyqWorkerExtension"
"""The worker extension class (`worker_extension_cls`), whose import registers the backend."""
