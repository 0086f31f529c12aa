"""Images of multimodal dataset rows: the forms a file may hold them in, checked when the file is read.

A row's image value is one image or a list of them; each image is

- a path (absolute, or relative to the dataset file's directory), or a `data:image/...;base64,` URI,
- encoded image bytes (a parquet `binary` cell),
- a `{"bytes": ..., "path": ...}` struct, as the `datasets` library writes an `Image` column to parquet
  (lmms-lab/multimodal-open-r1-8k-verified holds its images so): the bytes when present (bytes, or base64
  text in JSONL), else the path.

Images are kept encoded (PNG/JPEG bytes, as in the file) and decoded on use (`decode`): a dataset of
thousands of images stays the size of its file in memory. Each one is verified decodable when read, so a
bad image fails the run before it starts, naming its row.
"""

from __future__ import annotations

import base64
import binascii
import io
from pathlib import Path
from typing import Any


class ImageError(ValueError):
    """An image cell that is not an image skyq can read."""


def image_bytes(value: Any, *, base_dir: Path, where: str) -> tuple[bytes, ...]:
    """The encoded images of one row's image cell (one image or a list), each verified decodable.

    `where` names the row in errors (`<file>:<line>` or `<file> row <n>`).
    """
    items = value if isinstance(value, (list, tuple)) else [value]
    return tuple(
        _one_image(item, base_dir=base_dir, where=f"{where}: image {i}") for i, item in enumerate(items)
    )


def _one_image(item: Any, *, base_dir: Path, where: str) -> bytes:
    if isinstance(item, dict):
        if item.get("bytes") is not None:
            item = item["bytes"]
            if isinstance(item, str):
                item = _base64(item, where)
        elif item.get("path") is not None:
            item = item["path"]
        else:
            raise ImageError(f"{where}: an image struct with neither 'bytes' nor 'path' set")
    if isinstance(item, str):
        if item.startswith("data:"):
            item = _base64(item.partition(",")[2], where)
        else:
            item = _read(item, base_dir=base_dir, where=where)
    if not isinstance(item, (bytes, bytearray)):
        raise ImageError(
            f"{where}: {type(item).__name__} is not an image (a path, a data: URI, encoded bytes or a "
            "{'bytes', 'path'} struct)"
        )
    data = bytes(item)
    _verify(data, where)
    return data


def _base64(text: str, where: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError(f"{where}: image text is neither a path nor valid base64") from None


def _read(path_text: str, *, base_dir: Path, where: str) -> bytes:
    path = Path(path_text).expanduser()
    path = path if path.is_absolute() else base_dir / path
    if not path.is_file():
        raise ImageError(
            f"{where}: image file {path} does not exist (relative paths are read from the dataset file's "
            "directory)"
        )
    return path.read_bytes()


def _verify(data: bytes, where: str) -> None:
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as image:
            image.verify()
    except (UnidentifiedImageError, OSError, SyntaxError) as exc:
        raise ImageError(f"{where}: not a decodable image ({exc})") from None


def decode(data: bytes):
    """An encoded image as an RGB `PIL.Image.Image`, fully loaded."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as image:
        return image.convert("RGB")
