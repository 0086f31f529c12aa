"""What a checkpoint directory's config.json says about its model and quantization (read with json only).

Used by config validation to check checkpoint roles and shapes before anything starts. The config
may nest the text model (and its quantization block) under `text_config` (Kimi-K2.6); an int4->bf16
cast keeps the block in a sidecar `quantization_config.json`, which does not make the weights quantized.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional


@dataclass(frozen=True)
class CheckpointQuantization:
    path: str
    """The checkpoint directory."""
    quant_method: Optional[str]
    """`fp8`, `compressed-tensors`, ... or None for a plain (bf16) checkpoint."""
    block: dict[str, Any]
    """The raw quantization_config block ({} when there is none)."""
    arch: dict[str, Any]
    """The text model's config.json fields (`text_config` when nested), for the shape checks."""

    @property
    def is_quantized(self) -> bool:
        return self.quant_method is not None

    @property
    def ct_format(self) -> Optional[str]:
        """compressed-tensors `format` (e.g. pack-quantized, mxfp8-quantized)."""
        fmt = self.block.get("format") if self.quant_method == "compressed-tensors" else None
        return str(fmt) if fmt is not None else None

    @property
    def skipped_modules(self) -> list[str]:
        """The linears the checkpoint keeps unquantized (fp8's `modules_to_not_convert`,
        compressed-tensors' `ignore`; names or `re:` patterns)."""
        return [str(m) for m in self.block.get("modules_to_not_convert") or self.block.get("ignore") or []]

    @property
    def quantizes_attention(self) -> bool:
        """Whether attention linears are quantized: what tells an all-linear checkpoint from an
        expert-only one (every layout names attention `self_attn`; expert-only scopes keep it bf16)."""
        return not any("self_attn" in m for m in self.skipped_modules)

    @property
    def pow2_scales(self) -> bool:
        """FP8 blockwise scales declared powers of two (`scale_fmt: ue8m0`)."""
        return self.block.get("scale_fmt") == "ue8m0"

    def ct_weights(self) -> dict[str, Any]:
        """The `weights` args of the first compressed-tensors config group ({} if none)."""
        groups = self.block.get("config_groups") or {}
        for group in groups.values():
            return dict(group.get("weights") or {})
        return {}


def read_checkpoint_quantization(path: str) -> Optional[CheckpointQuantization]:
    """The quantization of the checkpoint at `path`, or None when the path does not exist."""
    cfg_path = Path(path) / "config.json"
    if not Path(path).exists():
        return None
    if not cfg_path.is_file():
        raise ValueError(f"checkpoint {path} has no config.json: is this an HF checkpoint directory?")
    try:
        hf = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{cfg_path} is not valid JSON ({exc}); the checkpoint is corrupt") from None
    text = hf["text_config"] if isinstance(hf.get("text_config"), dict) else hf
    block = dict(hf.get("quantization_config") or text.get("quantization_config") or {})
    method = block.get("quant_method")
    return CheckpointQuantization(path=str(path), quant_method=method, block=block, arch=dict(text))
