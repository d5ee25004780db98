"""Image content: decode encoded image bytes into verified pixels, and name them by content.

One place for what an image *is*, imported by the engine's server (to decode and key
images), by the gateway (to compare and route requests with images) and by the
linter (to tell whether an image changed between related requests). Torch-free, and Pillow-free at import: Pillow is imported inside the
functions that need it, so importing this module (and the gateway, for text-only
use) works without Pillow installed.

Decoding (:func:`decode_image`) accepts PNG, JPEG and WebP only (by content, not by
the media type a client claims), single-frame, at most :data:`MAX_IMAGE_PIXELS`
pixels, neither side zero, and fully decodable (a truncated file is refused, not
padded). Every refusal is a ``ValueError`` saying why.

The content hash (:func:`content_hash`), version 1, is the hex SHA256 of::

    b"prefixgate/image/v1\\0" | "<mode>,<width>,<height>" (ASCII) | b"\\0" | pixel bytes

where the pixels are converted to one canonical mode before ``tobytes()``: RGBA for
every mode whose conversion to RGBA is lossless (1, L, LA, P, PA, RGB, RGBA), so the
same picture sent as PNG (palette, gray or RGB) or as lossless WebP hashes alike;
any other mode (16-bit gray, CMYK, YCbCr, float...) keeps its own mode and bytes, so
two different pictures never meet through a lossy conversion. The width and height
are in the hashed header: two images whose pixel bytes agree but whose shapes
differ (2x8 and 4x4) never collide (vLLM's CVE-2025-46722). Metadata (EXIF, ICC,
the container) never enters the hash; the pixels are taken as decoded, without
applying EXIF orientation.

Invariant: equal hashes imply equal canonical pixels and shape, so any model input
derived from the decoded pixels (RGB conversion, resizing) is equal too.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from PIL.Image import Image

FORMATS = ("PNG", "JPEG", "WEBP")
"""Pillow format names of the accepted encodings."""

MAX_IMAGE_PIXELS = 40_000_000
"""Largest accepted ``width * height`` (an 8K frame is 33.2 M): a bound on decode memory."""

HASH_VERSION = b"prefixgate/image/v1\0"
HASH_STRIP_BYTES = 4 * 1024 * 1024
"""About how many canonical pixel bytes :func:`content_hash` converts at a time."""
_LOSSLESS_TO_RGBA = frozenset({"1", "L", "LA", "P", "PA", "RGB", "RGBA"})


def data_url_bytes(url: str) -> tuple[str, bytes]:
    """The media type and bytes of ``data:<media type>;base64,<payload>``; ValueError naming
    what is wrong. Whitespace in the payload (base64 line wrapping) is ignored."""
    if not url.startswith("data:"):
        raise ValueError(f"not a data: URL: {url[:40]!r}")
    header, sep, payload = url[5:].partition(",")
    if not sep:
        raise ValueError("data: URL has no ',' before its payload")
    params = header.split(";")
    media_type = params[0].strip().lower() or "text/plain"
    if "base64" not in (p.strip().lower() for p in params[1:]):
        raise ValueError("data: URL must be base64-encoded (';base64,')")
    if not media_type.startswith("image/"):
        raise ValueError(f"data: URL media type must be image/*, got {media_type!r}")
    try:
        return media_type, base64.b64decode("".join(payload.split()), validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"data: URL payload is not valid base64: {exc}") from exc


def decode_image(data: bytes, max_pixels: int = MAX_IMAGE_PIXELS) -> Image:
    """The verified, fully loaded image ``data`` encodes; ValueError saying why it is refused.
    ``max_pixels`` (at most :data:`MAX_IMAGE_PIXELS`) bounds ``width * height``."""
    try:
        from PIL import Image, UnidentifiedImageError
    except ImportError as exc:  # pragma: no cover - Pillow is an engine dependency
        raise ValueError("decoding images needs Pillow (pip install pillow)") from exc
    if not data:
        raise ValueError("image is empty")
    # Pillow's own bomb check (a warning past 89 M pixels, an error past twice that)
    # runs in open(); ours (MAX_IMAGE_PIXELS, lower) right after, before any pixel is
    # decoded. The warning filters are process-wide, so they are left alone here.
    try:
        image = Image.open(io.BytesIO(data), formats=FORMATS)
        _check_header(image, min(max_pixels, MAX_IMAGE_PIXELS))
        image.load()
    except UnidentifiedImageError as exc:
        raise ValueError(f"image is not a {', '.join(FORMATS)} file Pillow can read") from exc
    except Image.DecompressionBombError as exc:
        raise ValueError(f"image has too many pixels (the limit is {MAX_IMAGE_PIXELS})") from exc
    except (OSError, SyntaxError, EOFError) as exc:
        raise ValueError(f"image could not be decoded ({exc})") from exc
    return image


def _check_header(image: Image, max_pixels: int) -> None:
    width, height = image.size
    if width <= 0 or height <= 0:
        raise ValueError(f"image has a zero size ({width}x{height})")
    if width * height > max_pixels:
        raise ValueError(f"image is {width}x{height}, more than {max_pixels} pixels")
    if getattr(image, "n_frames", 1) != 1:
        raise ValueError("animated images are not supported; send one frame")


def canonical_mode(mode: str) -> str:
    """The mode an image of ``mode`` is hashed in (RGBA, or ``mode`` itself if lossy to convert)."""
    return "RGBA" if mode in _LOSSLESS_TO_RGBA else mode


def content_hash(image: Image) -> str:
    """Hex SHA256 over the canonical mode, the shape and the canonical pixel bytes (see module doc).

    The pixels are converted and hashed in horizontal strips of about
    :data:`HASH_STRIP_BYTES`: the same bytes in the same order as converting the whole
    image, without a second full-size copy (and a third for ``tobytes``) of a large image."""
    mode = canonical_mode(image.mode)
    width, height = image.size
    digest = hashlib.sha256(HASH_VERSION)
    digest.update(f"{mode},{width},{height}".encode("ascii") + b"\0")
    rows = max(1, HASH_STRIP_BYTES // (4 * width))
    for top in range(0, height, rows):
        strip = image.crop((0, top, width, min(height, top + rows)))
        digest.update((strip if strip.mode == mode else strip.convert(mode)).tobytes())
    return digest.hexdigest()


def image_pixels(data: bytes) -> int:
    """``width * height`` of the image ``data`` encodes, from its header alone (nothing is
    decoded); ValueError as :func:`decode_image` would refuse it by its header."""
    try:
        from PIL import Image, UnidentifiedImageError
    except ImportError as exc:  # pragma: no cover - Pillow is an engine dependency
        raise ValueError("decoding images needs Pillow (pip install pillow)") from exc
    if not data:
        raise ValueError("image is empty")
    try:
        with Image.open(io.BytesIO(data), formats=FORMATS) as image:
            _check_header(image, MAX_IMAGE_PIXELS)
            width, height = image.size
    except UnidentifiedImageError as exc:
        raise ValueError(f"image is not a {', '.join(FORMATS)} file Pillow can read") from exc
    except Image.DecompressionBombError as exc:
        raise ValueError(f"image has too many pixels (the limit is {MAX_IMAGE_PIXELS})") from exc
    except (OSError, SyntaxError, EOFError) as exc:
        raise ValueError(f"image could not be decoded ({exc})") from exc
    return width * height


@dataclass(frozen=True)
class ImageIdentity:
    """What the gateway and the linter call an image.

    ``exact`` is True when ``value`` is :func:`content_hash` (the engine's block-key
    identifier) and ``size`` is ``(width, height)``; False when Pillow is missing, could
    not decode the bytes or the image has more pixels than the caller decodes, and ``value`` is then ``"bytes:" + SHA256(encoded
    bytes)`` and ``size`` None: still stable for the same bytes, but the same pixels
    re-encoded get another value, and it never equals an engine identifier.
    """

    value: str
    exact: bool
    size: tuple[int, int] | None = None


def image_identity(data: bytes, max_pixels: int = MAX_IMAGE_PIXELS) -> ImageIdentity:
    """The content hash of ``data`` where Pillow decodes it (within ``max_pixels``: callers
    that must stay cheap, the gateway's checks, pass less), else a hash of the bytes."""
    try:
        image = decode_image(data, max_pixels)
        return ImageIdentity(content_hash(image), exact=True, size=image.size)
    except (ValueError, ImportError):
        return ImageIdentity("bytes:" + hashlib.sha256(data).hexdigest(), exact=False)
