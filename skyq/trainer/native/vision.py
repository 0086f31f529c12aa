"""Kimi-K2.6's vision side at any size: a MoonViT-style tower and the patch-merger projector, built
from `ModelConfig` under the public K2.5/K2.6 checkpoint names (`skyq.quant.layouts.vision`), and the
step that puts image embeddings where a prompt's image placeholder tokens are.

transformers 5 has `Kimi_K25ForConditionalGeneration` (MoonViT + projector + DeepSeek-V3), but it
renames the release's tensors on load (`wqkv` split into q/k/v, `norm0/1` -> `norm1/2`,
`mm_projector.proj.{0,2}` -> `in_proj/out_proj`, the text model under `model.language_model`). skyq's
layout, plan, wire and converters speak the release names, so the trainer and the engine build the
tower here with exactly those names (one fused `wqkv`, as the release and the wire hold it) and hold
it next to transformers' `DeepseekV3ForCausalLM`. The computation is MoonViT's: 14 x 14 patches by a
strided conv, the learned 64 x 64 position grid resampled (bicubic) to the image's patch grid,
pre-norm blocks (LayerNorm, full attention over the image's patches, a tanh-GELU MLP), a final
LayerNorm, then the projector: each patch normalized, 2 x 2 neighbours concatenated, Linear, GELU,
Linear to the text width. MoonViT's 2-D rotary embedding in the attention is left out (the learned
grid carries position); a release's weights load, but its outputs are not bit-compared here.

Images reach the model as `PromptImages` (encoded bytes + a token grid chosen by the task within
`task.max_image_tokens`, `skyq.rl.image_tokens`): both sides resize each image to exactly its grid
(28 pixels per token: 2 x 2 patches of 14) and normalize it the same way, so the trainer scores
the prompt the engine sampled from. Everything here stays bf16 on the wire in every precision (the
layout's `vision` role is never quantized); the trainer computes it from the bf16-rounded master
weights like every other unquantized tensor.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from skyq.config.schema import ModelConfig
from skyq.quant.layouts.vision import MERGE_PATCHES, PATCH_SIZE, POS_EMB_GRID
from skyq.rl.batch import PromptImages

HEAD_DIM = 72
"""Vision attention head width (MoonViT: 1152 = 16 heads x 72); `vision_hidden_size` is a multiple."""
MERGE = 2
"""Patches merged per side (2 x 2 = `MERGE_PATCHES`) into one image token."""
TOKEN_PIXELS = MERGE * PATCH_SIZE
"""Pixels per image token along each side (28)."""
NORM_EPS = 1e-5


class VisionBlock(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.heads = hidden // HEAD_DIM
        self.norm0 = nn.LayerNorm(hidden, eps=NORM_EPS)
        self.wqkv = nn.Linear(hidden, 3 * hidden)
        self.wo = nn.Linear(hidden, hidden)
        self.norm1 = nn.LayerNorm(hidden, eps=NORM_EPS)
        self.mlp = nn.Module()
        self.mlp.fc0 = nn.Linear(hidden, intermediate)
        self.mlp.fc1 = nn.Linear(intermediate, hidden)

    def forward(self, x: Tensor) -> Tensor:
        """x [patches, hidden]: one image's patches, attending to each other (no mask)."""
        q, k, v = self.wqkv(self.norm0(x)).unflatten(-1, (3, self.heads, HEAD_DIM)).permute(1, 2, 0, 3)
        attn = F.scaled_dot_product_attention(q, k, v).permute(1, 0, 2).flatten(1)
        x = x + self.wo(attn)
        return x + self.mlp.fc1(F.gelu(self.mlp.fc0(self.norm1(x)), approximate="tanh"))


class VisionTower(nn.Module):
    """MoonViT-style encoder: `patch_embed.{proj, pos_emb}`, `encoder.blocks.*`, `encoder.final_layernorm`."""

    def __init__(self, model_cfg: ModelConfig) -> None:
        super().__init__()
        d = model_cfg.vision_hidden_size
        self.patch_embed = nn.Module()
        self.patch_embed.proj = nn.Conv2d(3, d, kernel_size=PATCH_SIZE, stride=PATCH_SIZE)
        self.patch_embed.pos_emb = nn.Module()
        self.patch_embed.pos_emb.weight = nn.Parameter(torch.randn(POS_EMB_GRID, POS_EMB_GRID, d) * 0.02)
        self.encoder = nn.Module()
        self.encoder.blocks = nn.ModuleList(
            VisionBlock(d, model_cfg.vision_intermediate_size) for _ in range(model_cfg.vision_num_layers)
        )
        self.encoder.final_layernorm = nn.LayerNorm(d, eps=NORM_EPS)

    def forward(self, pixels: Tensor) -> Tensor:
        """pixels [3, H, W] (H, W multiples of 28) -> patch features [H/14, W/14, hidden]."""
        grid = self.patch_embed.proj(pixels[None].to(self.patch_embed.proj.weight.dtype))[0]  # [d, h, w]
        d, h, w = grid.shape
        table = self.patch_embed.pos_emb.weight.permute(2, 0, 1)[None]  # [1, d, 64, 64]
        if (h, w) != (POS_EMB_GRID, POS_EMB_GRID):
            table = F.interpolate(table.float(), size=(h, w), mode="bicubic", align_corners=False)
        x = (grid + table[0].to(grid.dtype)).flatten(1).T  # [h * w, d], row-major patches
        for block in self.encoder.blocks:
            x = block(x)
        return self.encoder.final_layernorm(x).view(h, w, d)


class Projector(nn.Module):
    """`mm_projector`: per-patch `pre_norm`, 2 x 2 patches concatenated, `proj.0` -> GELU -> `proj.2`."""

    def __init__(self, model_cfg: ModelConfig) -> None:
        super().__init__()
        d = model_cfg.vision_hidden_size
        self.pre_norm = nn.LayerNorm(d, eps=NORM_EPS)
        self.proj = nn.Sequential(
            nn.Linear(MERGE_PATCHES * d, MERGE_PATCHES * d),
            nn.GELU(),
            nn.Linear(MERGE_PATCHES * d, model_cfg.hidden_size),
        )

    def forward(self, patches: Tensor) -> Tensor:
        """patches [h, w, d] -> image tokens [h/2 * w/2, hidden], row-major over the token grid."""
        h, w, d = patches.shape
        x = self.pre_norm(patches).view(h // MERGE, MERGE, w // MERGE, MERGE, d)
        x = x.permute(0, 2, 1, 3, 4).reshape((h // MERGE) * (w // MERGE), MERGE_PATCHES * d)
        return self.proj(x)


def image_pixels(data: bytes, grid: tuple[int, int]) -> Tensor:
    """An encoded image as fp32 pixels [3, 28 * rows, 28 * cols] in [-1, 1] (MoonViT's 0.5 mean and std),
    resized (bicubic) to exactly its token grid `(rows, cols)`."""
    from PIL import Image

    from skyq.rl.images import decode

    rows, cols = grid
    image = decode(data).resize((cols * TOKEN_PIXELS, rows * TOKEN_PIXELS), Image.Resampling.BICUBIC)
    pixels = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8)
    pixels = pixels.view(rows * TOKEN_PIXELS, cols * TOKEN_PIXELS, 3).permute(2, 0, 1).float()
    return (pixels / 255.0 - 0.5) / 0.5


class ImageEncoder:
    """Image tokens of `PromptImages` through a tower and projector; each distinct image (its bytes and
    grid) encoded once per call, so the `n` samples of one prompt share one encoding."""

    def __init__(self, tower: nn.Module, projector: nn.Module) -> None:
        self.tower, self.projector = tower, projector
        self._done: dict[tuple[bytes, tuple[int, int]], Tensor] = {}

    def tokens(self, images: PromptImages) -> Tensor:
        """[sum of rows * cols, hidden]: every image's tokens, in prompt order."""
        out = []
        for data, grid in zip(images.images, images.grids, strict=True):
            key = (data, grid)
            if key not in self._done:
                weight = self.tower.patch_embed.proj.weight
                pixels = image_pixels(data, grid).to(device=weight.device)
                self._done[key] = self.projector(self.tower(pixels))
            out.append(self._done[key])
        return torch.cat(out)


def embed_with_images(
    embed_tokens: nn.Module,
    tower: nn.Module,
    projector: nn.Module,
    input_ids: Tensor,
    images: Sequence[PromptImages | None],
) -> Tensor:
    """[B, T, hidden] input embeddings of `input_ids` with row r's first `images[r].num_tokens` image
    placeholder tokens (`images[r].token_id`: the prompt's, expanded by the task to its images' grids)
    replaced, in order, by its images' tokens; fewer placeholders than that is an error."""
    if len(images) != input_ids.shape[0]:
        raise ValueError(f"{len(images)} image entries for {input_ids.shape[0]} rows")
    embeds = embed_tokens(input_ids)
    encoder = ImageEncoder(tower, projector)
    rows = []
    for r, row_images in enumerate(images):
        if row_images is None or not row_images.images:
            rows.append(embeds[r])
            continue
        tokens = encoder.tokens(row_images)
        # The prompt's placeholders come first; the same id sampled later in a response is an ordinary
        # token there, embedded as the engine embedded it when it decoded it.
        where = (input_ids[r] == row_images.token_id).nonzero().squeeze(-1)[: tokens.shape[0]]
        if where.numel() != tokens.shape[0]:
            raise ValueError(
                f"row {r}: {where.numel()} image placeholder tokens (id {row_images.token_id}) but its "
                f"{len(row_images.images)} image(s) give {tokens.shape[0]} tokens (grids {row_images.grids})"
            )
        rows.append(embeds[r].index_put((where,), tokens.to(embeds.dtype)))
    return torch.stack(rows)


class VisionLanguageModel(nn.Module):
    """The trainer's Kimi-K2.6-style model: a transformers causal LM (`model`, `lm_head`: its own names,
    without the checkpoint's `language_model.` prefix, as the trainer holds every text model) beside
    `vision_tower` and `mm_projector` (the checkpoint's names). A call with `images` runs the tower and
    projector and feeds the LM input embeddings; without, it is the LM's own call."""

    def __init__(self, lm: nn.Module, model_cfg: ModelConfig) -> None:
        super().__init__()
        self.model, self.lm_head = lm.model, lm.lm_head
        self.vision_tower = VisionTower(model_cfg)
        self.mm_projector = Projector(model_cfg)
        object.__setattr__(self, "_lm", lm)  # not a submodule: its parameters are registered above

    @property
    def config(self):
        return self._lm.config

    def forward(self, *, input_ids: Tensor, images: Sequence[PromptImages | None] | None = None, **kwargs):
        if images is None:
            return self._lm(input_ids=input_ids, **kwargs)
        embeds = embed_with_images(
            self.model.embed_tokens, self.vision_tower, self.mm_projector, input_ids, images
        )
        return self._lm(inputs_embeds=embeds, **kwargs)
