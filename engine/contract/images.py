"""ImageData: one ``image_url`` part decoded into verified pixels, named by their content hash.

``data:`` URLs carrying base64 (``data:image/png;base64,...``) are decoded here.
Remote (``http``/``https``) URLs are refused unless the server was started with
``--allowed-media-domains HOST...`` (a :class:`MediaPolicy`); :func:`load_image` never
opens a connection itself: the caller passes a ``fetch`` function, built by
:meth:`MediaPolicy.fetcher`, so what may reach the network is decided in one place.
A fetch is one GET of an allowed host over http(s), at most ``max_bytes`` and
``timeout_s`` in total; a redirect is followed (at most :data:`MAX_REDIRECTS`) only to
an allowed host. The server calls this from a worker thread, never on the event loop.

Invariant: ``ImageData.image`` is the decoded image, verified by
:func:`engine.contract.image_content.decode_image` (PNG, JPEG or WebP, bounded pixels, not
truncated), and ``ImageData.sha256`` is :func:`engine.contract.image_content.content_hash` of
it: a hash of the pixels and their shape, not of the URL or the encoded bytes. It is
the :class:`~engine.kvcache.block_hash.MultiModalItem` identifier, so the same picture
sent twice (whatever its encoding or base64 line wrapping) yields the same block hashes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import httpx

from engine.contract.image_content import content_hash, data_url_bytes, decode_image
from engine.contract.pixel_budget import DEFAULT_MAX_PIXELS_IN_FLIGHT

if TYPE_CHECKING:
    from PIL.Image import Image

MAX_IMAGE_BYTES = 20 * 1024 * 1024
FETCH_TIMEOUT_S = 10.0
MAX_REDIRECTS = 3
MAX_IMAGES_PER_REQUEST = 8

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
    return ImageData.from_bytes(data_url_bytes(url)[1])


def load_image(url: object, *, allow_remote: bool, fetch: ImageFetcher | None = None) -> ImageData:
    """The image an ``image_url.url`` names: decoded data: URLs, fetched remote ones if allowed."""
    return ImageData.from_bytes(image_bytes(url, allow_remote=allow_remote, fetch=fetch))


def image_bytes(url: object, *, allow_remote: bool, fetch: ImageFetcher | None = None) -> bytes:
    """The encoded bytes an ``image_url.url`` names (nothing decoded yet); ValueError saying why not."""
    if not isinstance(url, str) or not url:
        raise ValueError("image_url.url must be a non-empty string")
    if url.startswith("data:"):
        return data_url_bytes(url)[1]
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme not in ("http", "https"):
        raise ValueError(f"image URL scheme {scheme or '(none)'!r} is not supported; use a data: URL")
    if not allow_remote or fetch is None:
        raise ValueError(
            "remote image URLs are refused by this engine (start it with --allowed-media-domains HOST "
            "to allow a host); send the image inline as a data: URL"
        )
    return fetch(url)


@dataclass(frozen=True)
class MediaPolicy:
    """Which remote image URLs the server fetches (none unless ``allowed_domains`` names hosts),
    how many images one request may carry (each decoded image is held until the
    request is rendered: ``max_images_per_request`` x
    :data:`engine.contract.image_content.MAX_IMAGE_PIXELS` bounds it), and how many decoded
    pixels all requests together may hold (``max_pixels_in_flight``, see
    :mod:`engine.contract.pixel_budget`).

    Hosts match exactly, case-insensitively (``example.com`` does not allow
    ``cdn.example.com``). ``timeout_s`` bounds a whole fetch, redirects included.
    """

    allowed_domains: frozenset[str] = frozenset()
    timeout_s: float = FETCH_TIMEOUT_S
    max_bytes: int = MAX_IMAGE_BYTES
    max_images_per_request: int = MAX_IMAGES_PER_REQUEST
    max_pixels_in_flight: int = DEFAULT_MAX_PIXELS_IN_FLIGHT

    def __post_init__(self) -> None:
        domains = frozenset(d.strip().lower().rstrip(".") for d in self.allowed_domains)
        for domain in domains:
            if not domain or any(c in domain for c in "/:@ *"):
                raise ValueError(f"--allowed-media-domains takes host names, got {domain!r}")
        object.__setattr__(self, "allowed_domains", domains)
        if not self.timeout_s > 0:
            raise ValueError(f"media fetch timeout must be > 0 seconds, got {self.timeout_s!r}")
        if self.max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {self.max_bytes!r}")
        if self.max_images_per_request < 1:
            raise ValueError(f"max_images_per_request must be >= 1, got {self.max_images_per_request!r}")
        if self.max_pixels_in_flight < 1:
            raise ValueError(f"max_pixels_in_flight must be >= 1, got {self.max_pixels_in_flight!r}")

    @property
    def allows_remote(self) -> bool:
        return bool(self.allowed_domains)

    def fetcher(self, transport: httpx.BaseTransport | None = None) -> ImageFetcher | None:
        """The fetch function for this policy, or None when no host is allowed."""
        return http_fetcher(self, transport=transport) if self.allows_remote else None

    def check(self, url: httpx.URL) -> None:
        """ValueError unless ``url`` is http(s) on an allowed host."""
        if url.scheme not in ("http", "https"):
            raise ValueError(f"image URL scheme {url.scheme!r} is not supported")
        host = url.host.lower().rstrip(".")
        if host not in self.allowed_domains:
            raise ValueError(f"image host {host!r} is not in --allowed-media-domains")


def http_fetcher(policy: MediaPolicy, *, transport: httpx.BaseTransport | None = None) -> ImageFetcher:
    """A fetcher for ``policy``: GETs of allowed hosts only, bounded in time, size and redirects."""

    def fetch(url: str) -> bytes:
        deadline = time.monotonic() + policy.timeout_s
        try:
            target = httpx.URL(url)
        except httpx.InvalidURL as exc:
            raise ValueError(f"image URL is not valid: {exc}") from exc
        try:
            with httpx.Client(timeout=policy.timeout_s, follow_redirects=False, transport=transport,
                              trust_env=False) as client:
                for _ in range(MAX_REDIRECTS + 1):
                    policy.check(target)
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise ValueError("fetching the image took longer than the media fetch timeout")
                    with client.stream("GET", target, timeout=remaining) as response:
                        if response.is_redirect:
                            target = response.url.join(response.headers["location"])
                            continue
                        if response.status_code != 200:
                            raise ValueError(f"fetching the image answered HTTP {response.status_code}")
                        return _read_bounded(response, policy.max_bytes, deadline)
                raise ValueError(f"fetching the image took more than {MAX_REDIRECTS} redirects")
        except httpx.HTTPError as exc:
            raise ValueError(f"could not fetch the image: {type(exc).__name__}") from exc

    return fetch


def _read_bounded(response: httpx.Response, max_bytes: int, deadline: float) -> bytes:
    declared = response.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise ValueError(f"remote image is larger than {max_bytes} bytes")
    body = bytearray()
    for chunk in response.iter_bytes():
        body.extend(chunk)
        if len(body) > max_bytes:
            raise ValueError(f"remote image is larger than {max_bytes} bytes")
        if time.monotonic() > deadline:
            raise ValueError("fetching the image took longer than the media fetch timeout")
    return bytes(body)
