"""HF <-> Megatron-core name and shape tables (Qwen3-MoE, DeepSeek-V3 / Kimi), TP/EP slicing, the HF
checkpoint load into Megatron shards and the export of Megatron weights to HF names.

The tables (`tables`, `qwen3_moe`, `deepseek_v3`), the conversions (`convert`) and the slicing
(`sharding`) are pure functions over names and tensors; only `io` touches megatron-core
(`parallel_state`) and torch.distributed.
"""

from __future__ import annotations

from skyq.trainer.megatron.mapping.convert import hf_to_megatron, megatron_to_hf, parse
from skyq.trainer.megatron.mapping.io import export_hf, load_hf_checkpoint, model_tensors
from skyq.trainer.megatron.mapping.sharding import (
    Partition,
    global_name,
    local_name,
    partition,
    shard,
    unshard,
)
from skyq.trainer.megatron.mapping.tables import SPECS, Entry, Kind, MappingError, megatron_names, table

__all__ = [
    "SPECS",
    "Entry",
    "Kind",
    "MappingError",
    "Partition",
    "export_hf",
    "global_name",
    "hf_to_megatron",
    "load_hf_checkpoint",
    "local_name",
    "megatron_names",
    "megatron_to_hf",
    "model_tensors",
    "parse",
    "partition",
    "shard",
    "table",
    "unshard",
]
