"""Image parts as the linter sees them: what the image is, and about how many tokens it costs.

An image changes the prompt like text does: a later request that sends another
image where the earlier one had this one shares no KV block from that point on (an
engine keys every block an image overlaps by the image's hash). So the linter
renders each image part (:mod:`linter.render`) as a segment whose text names the
image and tokenizes to about the image's token count.

Identity (:attr:`ImagePart.identity`):

* a ``data:`` URL: :func:`engine.contract.image_content.image_identity` of its bytes, the
  engine's own content hash (pixels and shape) where Pillow is importable; without
  Pillow, for bytes Pillow cannot decode, or past :data:`MAX_DECODED_PIXELS` (the
  gateway checks requests from anyone within a time budget: a tiny file can claim
  40 M pixels), a hash of the encoded bytes (``exact`` False): the same image
  re-encoded (PNG vs WebP) then counts as changed;
* a remote URL: the URL itself (``url:...``): the linter never fetches, so the same
  URL is assumed to name the same image;
* anything else (no URL, bad base64): ``invalid:`` and a hash of the part's JSON.

Tokens (:func:`estimate_tokens`): OpenAI's published count for its tile-based
vision models, the one count a client-side tool can name without knowing the
model: ``detail: "low"`` is 85 tokens; otherwise the image is scaled to fit
2048x2048, then its shorter side down to 768, and costs 85 + 170 per 512-pixel tile
(a 1024x1024 image: 765). When the size is unknown (a remote URL, no Pillow) an
image counts 765. Local vision-language models differ (LLaVA-1.5: 576 per image);
the figure sizes ``tokens_lost``, it is not the engine's count.

Decoding is memoized per URL (by its SHA256, at most :data:`MEMO_SIZE` entries):
the gateway compares every turn with the previous one, and a conversation's images
repeat in each, so each image is decoded once.

Pixel budget (:func:`pixel_budget`): a caller that must bound its work (the gateway,
per request and per tenant) runs the linter inside ``with pixel_budget(PixelBudget(n))``;
images are then decoded only while their pixels fit in what is left of ``n``, and the
rest are named by a hash of their bytes (as past :data:`MAX_DECODED_PIXELS`); the
budget's ``used`` counts the pixels decoded. Such a fallback identity is not
memoized, so one request's empty budget never fixes an image's name for later ones;
within one budget the same bytes always get the same name, so two turns are
compared consistently. Without a budget (the command line) every image is decoded.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import math
import threading
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from engine.contract.image_content import data_url_bytes, image_identity
from linter.canonical_json import canonical_text

LOW_DETAIL_TOKENS = 85
TILE_TOKENS = 170
UNKNOWN_SIZE_TOKENS = LOW_DETAIL_TOKENS + 4 * TILE_TOKENS
MEMO_SIZE = 256
MAX_DECODED_PIXELS = 2048 * 2048
IMAGE_TYPES = ("image_url", "input_image")


@dataclass(frozen=True)
class ImagePart:
    """One image part: ``identity`` (see the module docstring), whether it is the engine's
    content hash (``exact``), its pixel size when decoded, and the estimated ``tokens``."""

    identity: str
    exact: bool
    size: tuple[int, int] | None
    tokens: int

    @property
    def short(self) -> str:
        """A short name for messages and rendered text: 16 hex digits of the content hash,
        or ``url:``, ``bytes:`` or ``invalid:`` and 12 hex digits when it is not one."""
        if self.exact:
            return self.identity[:16]
        kind = self.identity.split(":", 1)[0]
        return f"{kind}:{hashlib.sha256(self.identity.encode()).hexdigest()[:12]}"


_memo: OrderedDict[bytes, tuple[str, bool, tuple[int, int] | None]] = OrderedDict()
_memo_lock = threading.Lock()


@dataclass
class PixelBudget:
    """Pixels one bounded check may still decode (``limit``), and how many it did (``used``)."""

    limit: int
    used: int = 0

    @property
    def left(self) -> int:
        return max(0, self.limit - self.used)


_budget: contextvars.ContextVar[PixelBudget | None] = contextvars.ContextVar("pixel_budget", default=None)


@contextlib.contextmanager
def pixel_budget(budget: PixelBudget) -> Iterator[PixelBudget]:
    """Decode at most ``budget.left`` pixels of images (in all) in this context, counting
    them in ``budget.used`` (see the module docstring)."""
    token = _budget.set(budget)
    try:
        yield budget
    finally:
        _budget.reset(token)


def image_part(part: Mapping[str, Any]) -> ImagePart | None:
    """The image a chat ``image_url`` or Responses ``input_image`` part sends; None for other parts."""
    kind = part.get("type")
    if kind not in IMAGE_TYPES:
        return None
    spec = part.get("image_url")
    url = spec.get("url") if isinstance(spec, Mapping) else spec
    detail_from = spec if kind == "image_url" and isinstance(spec, Mapping) else part
    detail = detail_from.get("detail")
    identity, exact, size = _identify(url, part)
    return ImagePart(identity, exact, size, estimate_tokens(size, detail))


def _identify(url: object, part: Mapping[str, Any]) -> tuple[str, bool, tuple[int, int] | None]:
    if not isinstance(url, str) or not url:
        return "invalid:" + hashlib.sha256(canonical_text(dict(part)).encode()).hexdigest(), False, None
    if not url.startswith("data:"):
        return "url:" + url, False, None
    key = hashlib.sha256(url.encode("utf-8", "surrogatepass")).digest()
    with _memo_lock:
        found = _memo.get(key)
        if found is not None:
            _memo.move_to_end(key)
            return found
    budget = _budget.get()
    allowed = MAX_DECODED_PIXELS if budget is None else min(MAX_DECODED_PIXELS, budget.left)
    try:
        data = data_url_bytes(url)[1]
        if allowed:
            identity = image_identity(data, allowed)
            result = (identity.value, identity.exact, identity.size)
        else:  # nothing left to decode: not even the header is parsed
            result = ("bytes:" + hashlib.sha256(data).hexdigest(), False, None)
    except ValueError:
        result = ("invalid:" + key.hex(), False, None)
    if budget is not None and result[2] is not None:
        budget.used += result[2][0] * result[2][1]
    elif budget is not None and allowed < MAX_DECODED_PIXELS and result[0].startswith("bytes:"):
        return result  # perhaps only for want of budget: not the image's name for good
    with _memo_lock:
        _memo[key] = result
        if len(_memo) > MEMO_SIZE:
            _memo.popitem(last=False)
    return result


def estimate_tokens(size: tuple[int, int] | None, detail: object = None) -> int:
    """Estimated prompt tokens of one image (see the module docstring)."""
    if detail == "low":
        return LOW_DETAIL_TOKENS
    if size is None:
        return UNKNOWN_SIZE_TOKENS
    fit = min(1.0, 2048 / max(size))
    scale = fit * min(1.0, 768 / (min(size) * fit))
    tiles = math.ceil(size[0] * scale / 512) * math.ceil(size[1] * scale / 512)
    return LOW_DETAIL_TOKENS + TILE_TOKENS * tiles
