"""Write a synthetic multimodal task and a tiny Kimi-K2.6-style checkpoint to train on it, on the CPU.

    python -m skyq.tools.make_dot_count <dir> [--rows 24] [--max-dots 3] [--seed 0]

`<dir>/dots.jsonl` is an open-r1 multimodal dataset (the layout `task=multimodal_open_r1` reads, with
its images as relative paths under `<dir>/images/`): each image is a white 56 x 56 square with 1 to
`--max-dots` black dots, the prompt "<image>n=" (a chat list, so open-r1's long instruction is not
appended), the answer the number of dots. `<dir>/checkpoint/` holds `model=tiny_kimi_vl` at its seeded
random init (bf16 safetensors + config.json) and a one-character-per-token tokenizer whose chat template
renders each image as Kimi's `<|media_pad|>` placeholder. Then (recipes/tiny_kimi_vl_int4_qat_cpu_dots.yaml):

    python -m skyq.train recipe=tiny_kimi_vl_int4_qat_cpu_dots checkpoint.hf_checkpoint=<dir>/checkpoint \\
        task.dataset=<dir>/dots.jsonl

Nothing is downloaded; the same seed writes the same files.
"""

from __future__ import annotations

import io
import json
import random
import sys
from collections.abc import Sequence
from pathlib import Path

from skyq.rl.image_tokens import IMAGE_TOKEN
from skyq.tools.cli import ToolArgumentParser, run_tool

IMAGE_SIDE = 56
"""Pixels per image side: 2 x 2 image tokens of 28 pixels."""
DOT_RADIUS = 5
SPECIALS = ["<pad>", "<bos>", "<eos>", IMAGE_TOKEN]
CHARACTERS = "0123456789n="
CHAT_TEMPLATE = (
    "<bos>{% for m in messages %}{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for p in m['content'] %}{% if p['type'] == 'image' %}" + IMAGE_TOKEN + "{% else %}{{ p['text'] }}"
    "{% endif %}{% endfor %}{% endif %}{% endfor %}"
)
"""Renders a chat as its text with one placeholder per image part (no role markers: a tiny vocabulary)."""
PROMPT = "<image>n="


def dot_image(count: int, rng: random.Random) -> bytes:
    """PNG bytes of a white square with `count` black dots that do not touch."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (IMAGE_SIDE, IMAGE_SIDE), "white")
    draw = ImageDraw.Draw(image)
    centres: list[tuple[int, int]] = []
    while len(centres) < count:
        c = (
            rng.randrange(DOT_RADIUS + 1, IMAGE_SIDE - DOT_RADIUS - 1),
            rng.randrange(DOT_RADIUS + 1, IMAGE_SIDE - DOT_RADIUS - 1),
        )
        if all((c[0] - x) ** 2 + (c[1] - y) ** 2 > (3 * DOT_RADIUS) ** 2 for x, y in centres):
            centres.append(c)
    for x, y in centres:
        draw.ellipse((x - DOT_RADIUS, y - DOT_RADIUS, x + DOT_RADIUS, y + DOT_RADIUS), fill="black")
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def write_dataset(directory: Path, *, rows: int, max_dots: int, seed: int) -> Path:
    """`directory/dots.jsonl` and its images; returns the JSONL path."""
    if rows < 1 or not 1 <= max_dots <= 9:
        raise ValueError(f"--rows={rows} must be >= 1 and --max-dots={max_dots} in 1..9 (one-digit answers)")
    rng = random.Random(seed)
    (directory / "images").mkdir(parents=True, exist_ok=True)
    lines = []
    for i in range(rows):
        count = 1 + i % max_dots
        name = f"images/{i:05d}.png"
        (directory / name).write_bytes(dot_image(count, rng))
        prompt = [{"role": "user", "content": PROMPT}]
        lines.append(json.dumps({"image": name, "problem": prompt, "solution": str(count)}))
    path = directory / "dots.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def save_tokenizer(directory: Path) -> None:
    """The one-character-per-token tokenizer (transformers files) with `IMAGE_TOKEN` as a special token."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate([*SPECIALS, *CHARACTERS])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        additional_special_tokens=[IMAGE_TOKEN],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(directory)


def write_checkpoint(directory: Path, *, seed: int) -> Path:
    """`model=tiny_kimi_vl` at its seeded init as a bf16 HF checkpoint, with the tokenizer beside it."""
    from skyq.config.store import compose, to_object
    from skyq.trainer.native.model import build_model, hf_state, write_hf_checkpoint

    model_cfg = to_object(compose(["model=tiny_kimi_vl"])).model
    write_hf_checkpoint(directory, hf_state(build_model(model_cfg, seed=seed), model_cfg), model_cfg)
    save_tokenizer(directory)
    return directory


def main(argv: Sequence[str] | None = None) -> int:
    parser = ToolArgumentParser(
        prog="python -m skyq.tools.make_dot_count", description=__doc__.split("\n")[0]
    )
    parser.add_argument("directory", type=Path)
    parser.add_argument("--rows", type=int, default=24)
    parser.add_argument("--max-dots", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    directory = args.directory.expanduser().resolve()
    data = write_dataset(directory, rows=args.rows, max_dots=args.max_dots, seed=args.seed)
    checkpoint = write_checkpoint(directory / "checkpoint", seed=args.seed)
    print(f"wrote {data} ({args.rows} rows) and {checkpoint}")
    print(
        "train: python -m skyq.train recipe=tiny_kimi_vl_int4_qat_cpu_dots "
        f"checkpoint.hf_checkpoint={checkpoint} task.dataset={data}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(run_tool(main))
