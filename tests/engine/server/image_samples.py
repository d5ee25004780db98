"""Real encoded images for tests: small pictures made with Pillow, as bytes and as data: URLs."""

from __future__ import annotations

import base64
import io

from PIL import Image


def picture(width: int = 8, height: int = 6, seed: int = 0, mode: str = "RGB") -> Image.Image:
    """A deterministic picture whose pixels depend on ``seed`` (every pixel differs from its neighbours)."""
    image = Image.new("RGB", (width, height))
    image.putdata([((x * 37 + seed * 11) % 256, (y * 53 + seed * 7) % 256, (x * y + seed) % 256)
                   for y in range(height) for x in range(width)])
    return image.convert(mode)


def encode(image: Image.Image, fmt: str = "PNG", **params: object) -> bytes:
    out = io.BytesIO()
    image.save(out, format=fmt, **params)
    return out.getvalue()


def png(width: int = 8, height: int = 6, seed: int = 0) -> bytes:
    return encode(picture(width, height, seed))


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"
