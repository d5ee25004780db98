"""Pictures and chat messages for the tiny vision-language model tests."""

from __future__ import annotations

import base64
import io

import numpy as np

ARCHS = ("llava", "idefics3")


def picture(seed: int, size: tuple[int, int] = (32, 32)):
    """A random RGB PIL image (``size`` = width, height)."""
    from PIL import Image

    pixels = np.random.RandomState(seed).randint(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def data_url(image, fmt: str = "PNG") -> str:
    buf = io.BytesIO()
    image.save(buf, format=fmt, **({"lossless": True} if fmt == "WEBP" else {}))
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


def image_message(image, text: str = "What is in this picture?", fmt: str = "PNG") -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": text},
                                         {"type": "image_url", "image_url": {"url": data_url(image, fmt)}}]}]
