"""ImageData: one ``image_url`` part decoded into verified pixels, named by their content hash.

Only ``data:`` URLs carrying base64 (``data:image/png;base64,...``) are decoded here.
Remote (``http``/``https``) URLs are refused unless the server was started with
``--allow-remote-images``; even then this module never opens a connection itself:
the caller passes a ``fetch`` function, so what may reach the network is decided in
one place (the server) and tests never fetch.

Invariant: ``ImageData.image`` is the decoded image, verified by
:func:`engine.image_content.decode_image` (PNG, JPEG or WebP, bounded pixels, not
truncated), and ``ImageData.sha256`` is :func:`engine.image_content.content_hash` of
it: a hash of the pixels and their shape, not of the URL or the encoded bytes. It is
the :class:`~engine.kvcache.block_hash.MultiModalItem` identifier, so the same picture
sent twice (whatever its encoding or base64 line wrapping) yields the same block hashes.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import httpx

from engine.image_content import content_hash, decode_image

if TYPE_CHECKING:
    from PIL.Image import Image

MAX_IMAGE_BYTES = 20 * 1024 * 1024
FETCH_TIMEOUT_S = 10.0

ImageFetcher = Callable[[str], bytes]


@dataclass(frozen=True)
class ImageData:
    """Encoded bytes, the media type of what they decoded as, the image, and its content hash."""

    data: bytes = field(repr=False)
    media_type: str
    sha256: str
    image: Image = field(repr=False, compare=False)

    @classmethod
    def from_bytes(cls, data: bytes) -> ImageData:
        """Decode and verify ``data``; ValueError saying why an image is refused."""
        if not data:
            raise ValueError("image is empty")
        if len(data) > MAX_IMAGE_BYTES:
            raise ValueError(f"image has {len(data)} bytes, more than the limit of {MAX_IMAGE_BYTES}")
        image = decode_image(data)
        media_type = f"image/{(image.format or 'unknown').lower()}"
        return cls(data=data, media_type=media_type, sha256=content_hash(image), image=image)


def decode_data_url(url: str) -> ImageData:
    """Decode ``data:<media type>;base64,<payload>``; ValueError naming what is wrong."""
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
    compact = "".join(payload.split())
    try:
        data = base64.b64decode(compact, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"data: URL payload is not valid base64: {exc}") from exc
    return ImageData.from_bytes(data)


def load_image(url: object, *, allow_remote: bool, fetch: ImageFetcher | None = None) -> ImageData:
    """The image an ``image_url.url`` names: decoded data: URLs, fetched remote ones if allowed."""
    if not isinstance(url, str) or not url:
        raise ValueError("image_url.url must be a non-empty string")
    if url.startswith("data:"):
        return decode_data_url(url)
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme not in ("http", "https"):
        raise ValueError(f"image URL scheme {scheme or '(none)'!r} is not supported; use a data: URL")
    if not allow_remote or fetch is None:
        raise ValueError(
            "remote image URLs are refused by this engine (start it with --allow-remote-images "
            "to allow them); send the image inline as a data: URL"
        )
    return ImageData.from_bytes(fetch(url))


def http_fetcher(*, timeout_s: float = FETCH_TIMEOUT_S, max_bytes: int = MAX_IMAGE_BYTES,
                 transport: httpx.BaseTransport | None = None) -> ImageFetcher:
    """A fetcher for ``--allow-remote-images``: one GET, no redirects, bounded time and size."""

    def fetch(url: str) -> bytes:
        try:
            with httpx.Client(timeout=timeout_s, follow_redirects=False, transport=transport) as client, \
                    client.stream("GET", url) as response:
                if response.status_code != 200:
                    raise ValueError(f"fetching the image answered HTTP {response.status_code}")
                body = bytearray()
                for chunk in response.iter_bytes():
                    body.extend(chunk)
                    if len(body) > max_bytes:
                        raise ValueError(f"remote image is larger than {max_bytes} bytes")
                return bytes(body)
        except httpx.HTTPError as exc:
            raise ValueError(f"could not fetch the image: {type(exc).__name__}") from exc

    return fetch
