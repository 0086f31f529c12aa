"""Kimi-K2.5 / K2.6 vision tower (MoonViT) and patch-merger projector: names and shapes.

Names follow the public Kimi-K2.5/K2.6 checkpoint. The dims the model config does not carry are
fixed by that architecture and written here once: 14 x 14 RGB patches, a 64 x 64 learned position
grid, and a 2 x 2 patch merge before the projector (so the projector input is 4 x vision_hidden_size).
All of it stays bf16 under every precision (FORMATS.md "What is never quantized").
"""

from __future__ import annotations

from functools import lru_cache

from skyq.config.schema import ModelConfig

PATCH_SIZE = 14
"""Vision patch edge in pixels (Conv2d kernel and stride of `patch_embed.proj`)."""
POS_EMB_GRID = 64
"""Learned 2-D position-embedding grid edge (`patch_embed.pos_emb.weight` is [64, 64, D])."""
MERGE_PATCHES = 4
"""Patches merged (2 x 2) into one projector input token."""
VISION_PREFIXES = ("vision_tower.", "mm_projector.")


def is_vision_name(name: str) -> bool:
    """Whether a checkpoint name belongs to the vision tower or the projector."""
    return name.startswith(VISION_PREFIXES)


def vision_parameters(model_cfg: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every vision-tower and projector tensor, tower first, blocks in order."""
    d, i, h = model_cfg.vision_hidden_size, model_cfg.vision_intermediate_size, model_cfg.hidden_size
    merged = MERGE_PATCHES * d
    out: list[tuple[str, tuple[int, ...]]] = [
        ("vision_tower.patch_embed.proj.weight", (d, 3, PATCH_SIZE, PATCH_SIZE)),
        ("vision_tower.patch_embed.proj.bias", (d,)),
        ("vision_tower.patch_embed.pos_emb.weight", (POS_EMB_GRID, POS_EMB_GRID, d)),
    ]
    for b in range(model_cfg.vision_num_layers):
        block = f"vision_tower.encoder.blocks.{b}."
        out += [
            (block + "norm0.weight", (d,)),
            (block + "norm0.bias", (d,)),
            (block + "wqkv.weight", (3 * d, d)),
            (block + "wqkv.bias", (3 * d,)),
            (block + "wo.weight", (d, d)),
            (block + "wo.bias", (d,)),
            (block + "norm1.weight", (d,)),
            (block + "norm1.bias", (d,)),
            (block + "mlp.fc0.weight", (i, d)),
            (block + "mlp.fc0.bias", (i,)),
            (block + "mlp.fc1.weight", (d, i)),
            (block + "mlp.fc1.bias", (d,)),
        ]
    out += [
        ("vision_tower.encoder.final_layernorm.weight", (d,)),
        ("vision_tower.encoder.final_layernorm.bias", (d,)),
        ("mm_projector.pre_norm.weight", (d,)),
        ("mm_projector.pre_norm.bias", (d,)),
        ("mm_projector.proj.0.weight", (merged, merged)),
        ("mm_projector.proj.0.bias", (merged,)),
        ("mm_projector.proj.2.weight", (h, merged)),
        ("mm_projector.proj.2.bias", (h,)),
    ]
    return out


def vision_names(model_cfg: ModelConfig) -> frozenset[str]:
    """The set of vision names of a model config (empty for a text-only model)."""
    return _vision_names(
        model_cfg.vision_num_layers, model_cfg.vision_hidden_size, model_cfg.vision_intermediate_size
    )


@lru_cache(maxsize=8)
def _vision_names(layers: int, hidden: int, intermediate: int) -> frozenset[str]:
    # Shapes do not matter for names; a placeholder text hidden size keeps this keyed on vision dims.
    if layers == 0:
        return frozenset()
    probe = ModelConfig(
        vision_num_layers=layers, vision_hidden_size=hidden, vision_intermediate_size=intermediate
    )
    return frozenset(name for name, _ in vision_parameters(probe))
