"""HF safetensors checkpoints: reading, crash-safe writing, and the offline converters.

- `reader` — a sharded checkpoint (index + shards), structurally verified, tensors found via the index
- `atomic` — temp file + fsync + rename, the only way a final-named file appears
- `output` — a converter's save dir: resume via a done-log, manifest, index and config written last
- `manifest` — `skyq_manifest.json`: sha256 of every file we wrote, checked by `inspect --verify`
- `hf_config` — a skyq `ModelConfig` derived from a checkpoint's `config.json`
- `pipeline` — the streaming read -> convert -> write loop shared by every converter
- `fp8_convert`, `fp8_dequant`, `int4_convert`, `int4_dequant` — the per-shard transforms
- `inspect_checkpoint` — format detection and verification behind `python -m skyq.tools.inspect`
"""
