"""ChatRenderer: OpenAI chat messages -> prompt token ids (+ image items) via the chat template.

The chat template always comes from the tokenizer. Before the template sees them,
messages are normalized so that every template gets plain strings:

* ``content`` may be a string, null, or a list of parts. Text parts are joined with
  a single ``"\\n"`` between consecutive parts, in order, with no trimming (the
  join is deterministic: the same parts always give the same string). An image part
  contributes its placeholder text at its place in that join.
* ``developer`` becomes ``system`` when the template does not mention ``developer``.
* ``tools`` go to the template when its source mentions ``tools``. Otherwise they
  are not dropped: each tool's JSON (keys in the order given) is written on its own
  line under a header into the system message (a new first system message if there
  is none), followed by how to call them (:data:`engine.contract.tool_call_format.CALL_INSTRUCTIONS`),
  and an assistant message's ``tool_calls`` are appended to its content in that
  same form, so tools always change the prompt (and its cache key) deterministically
  and the model sees its earlier calls as it was asked to write them.

Images: a model that does not accept images answers 400 "model does not accept
images". Each image part is loaded (data: URLs only unless remote images are
allowed) and its header read; the pixels of all the request's images are then
reserved in one piece from the server's :class:`~engine.contract.pixel_budget.PixelBudget`
(429 ``rate_limit_exceeded`` when it stays full, 400 when they exceed it alone)
and held while the images are decoded, named by their content hash
(:class:`~engine.contract.images.ImageData`) and processed; the reservation ends
with the rendering.

* A vision-language model (an :class:`~engine.multimodal.processor.ImagePromptProcessor`
  is configured): the checkpoint's chat template (the processor's, else the
  tokenizer's) gets every message's content as a list of parts in OpenAI/HF form
  (``{"type": "text", "text": ...}``, ``{"type": "image"}``), so it writes the
  model's own image marker; the rendered text and the images then go through the
  checkpoint's processor, which expands each marker to the image's placeholder
  tokens (for Idefics3 the count depends on the image size). Each image's range and
  pixels come back with it; a :class:`~engine.kvcache.block_hash.MultiModalItem`
  covers the range.
* A fixed-size :class:`ImagePlaceholder`: the placeholder token is expanded to
  ``tokens_per_image`` positions covered by the item (no model consumes them).

The template is rendered to text and then encoded without added special tokens, all
under one lock (HF tokenizers are not safe to share); a vision-language model's images
and text go through its processor under the processor's own lock and with its own
copy of the tokenizer, so text-only requests never wait for another request's images.
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from engine.contract.errors import APIError, invalid_param
from engine.contract.image_content import image_pixels
from engine.contract.images import ImageData, ImageFetcher, image_bytes
from engine.contract.pixel_budget import PixelBudget, PixelBudgetBusy, PixelBudgetTooSmall
from engine.contract.tool_call_format import CALL_INSTRUCTIONS, render_call
from engine.kvcache.block_hash import MultiModalItem


class ProcessedImages(Protocol):
    """What an image processor gives back: the prompt's ids, one item per image, its inputs."""

    @property
    def token_ids(self) -> list[int]: ...
    @property
    def items(self) -> tuple[MultiModalItem, ...]: ...
    @property
    def inputs(self) -> tuple[Any, ...]: ...


class ImagePromptProcessor(Protocol):
    """The renderer's view of a vision-language checkpoint's processor
    (:class:`engine.multimodal.processor.ImagePromptProcessor`, torch; named here by shape
    only, so that the gateway importing this module imports no torch)."""

    @property
    def chat_template(self) -> str | None: ...
    @property
    def image_text(self) -> str: ...
    @property
    def image_token_id(self) -> int: ...
    def encode(self, text: str, images: Sequence[Any], identifiers: Sequence[str]) -> ProcessedImages: ...

ROLES = ("system", "developer", "user", "assistant", "tool")
PART_JOIN = "\n"
TOOLS_HEADER = "You may call the following tools. Each line is one tool as JSON:"


@dataclass(frozen=True)
class ImagePlaceholder:
    """How an image-capable model marks an image: ``text`` encodes to the one token ``token_id``."""

    text: str
    token_id: int
    tokens_per_image: int


@dataclass(frozen=True)
class _EncodedImage:
    """An image part read but not decoded yet: where it is, its bytes, its pixel count."""

    param: str
    data: bytes
    pixels: int


@dataclass(frozen=True)
class ChatPrompt:
    """``mm_inputs``: one :class:`~engine.multimodal.processor.ImageInput` per item for a
    vision-language model (empty otherwise)."""

    token_ids: list[int]
    mm_items: tuple[MultiModalItem, ...] = ()
    images: tuple[ImageData, ...] = ()
    mm_inputs: tuple[Any, ...] = ()
    text: str | None = None  # the rendered text the ids were tokenized from (text-only prompts)


class ChatRenderer:
    """Renders chat requests for one tokenizer; thread-safe."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        supports_images: bool = False,
        image_placeholder: ImagePlaceholder | None = None,
        allow_remote_images: bool = False,
        fetch: ImageFetcher | None = None,
        image_processor: ImagePromptProcessor | None = None,
        pixel_budget: PixelBudget | None = None,
    ) -> None:
        """``pixel_budget``: shared by the renderers of one server (None: images unbounded
        across requests, as for the gateway's routing, which decodes none)."""
        self.tokenizer = tokenizer
        self.pixel_budget = pixel_budget
        self.image_processor = image_processor
        self.supports_images = image_processor is not None or (supports_images and image_placeholder is not None)
        self.image_placeholder = image_placeholder
        self.allow_remote_images = allow_remote_images
        self.fetch = fetch
        self.chat_template = image_processor.chat_template if image_processor is not None else None
        source = self.chat_template or _template_source(tokenizer)
        self.template_has_tools = "tools" in source
        self.template_has_developer = "developer" in source
        self._lock = threading.Lock()
        self.max_token_chars = max_token_chars(tokenizer)

    @property
    def lock(self) -> threading.Lock:
        """Held around every use of the tokenizer here; other users of the same tokenizer
        (the PML compiler) hold it too, as ``transformers`` tokenizers are not safe to
        reconfigure while another thread encodes."""
        return self._lock

    def render(self, messages: Sequence[dict[str, Any]],
               tools: list[dict[str, Any]] | None = None) -> ChatPrompt:
        """Token ids of the conversation followed by the assistant's generation prompt."""
        encoded: list[_EncodedImage] = []
        conversation = [self._message(i, m, encoded) for i, m in enumerate(messages)]
        with self._reserve(sum(e.pixels for e in encoded)):
            images = [self._decode(e) for e in encoded]
            return self._render(conversation, tools, images)

    def _render(self, conversation: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                images: list[ImageData]) -> ChatPrompt:
        if tools and not self.template_has_tools:
            conversation = _inline_tools(conversation, tools)
        kwargs: dict[str, Any] = {"add_generation_prompt": True, "tokenize": False}
        if tools and self.template_has_tools:
            kwargs["tools"] = tools
        if self.chat_template is not None:
            kwargs["chat_template"] = self.chat_template
        if self.image_processor is not None:
            conversation = [{**m, "content": _as_parts(m["content"])} for m in conversation]
        with self._lock:
            try:
                text = self.tokenizer.apply_chat_template(conversation, **kwargs)
            except Exception as exc:  # jinja errors, raise_exception(...) in templates
                raise invalid_param(f"The chat template rejected the messages: {exc}", "messages",
                                    "invalid_messages") from exc
            if self.image_processor is None or not images:
                token_ids = list(self.tokenizer.encode(text, add_special_tokens=False))
        if self.image_processor is not None:
            # The processor has its own lock and tokenizer: a request's images are processed
            # (seconds for large ones) without holding up text-only requests on this lock.
            return self._process(text, images) if images else self._text_only(token_ids)
        if not images:
            return ChatPrompt(token_ids, text=text)
        return self._expand_images(token_ids, images)

    def encode(self, text: str) -> list[int]:
        """Token ids of a raw completion prompt, with the tokenizer's special tokens (as vLLM)."""
        with self._lock:
            return list(self.tokenizer.encode(text))

    # --------------------------------------------------------------- messages
    def _message(self, index: int, message: dict[str, Any], images: list[_EncodedImage]) -> dict[str, Any]:
        role = message.get("role")
        if role not in ROLES:
            raise invalid_param(f"messages[{index}].role must be one of {list(ROLES)}, got {role!r}.",
                                f"messages[{index}].role")
        if role == "developer" and not self.template_has_developer:
            role = "system"
        out: dict[str, Any] = {"role": role,
                               "content": self._content(index, message.get("content"), images)}
        for key in ("name", "tool_call_id", "tool_calls"):
            if message.get(key) is not None:
                out[key] = message[key]
        return out

    def _content(self, index: int, content: object, images: list[_EncodedImage]) -> str | list[dict[str, str]]:
        if content is None:
            return ""
        if isinstance(content, str):
            return content
        param = f"messages[{index}].content"
        if not isinstance(content, list):
            raise invalid_param(f"{param} must be a string or an array of content parts.", param,
                                "invalid_type")
        pieces = [self._part(f"{param}[{j}]", part, images) for j, part in enumerate(content)]
        if self.image_processor is not None:
            return [{"type": "image"} if p is _IMAGE else {"type": "text", "text": p} for p in pieces]
        return PART_JOIN.join(pieces)

    def _part(self, param: str, part: object, images: list[_EncodedImage]) -> str:
        kind = part.get("type") if isinstance(part, dict) else None
        if isinstance(part, dict) and kind == "text" and isinstance(part.get("text"), str):
            return str(part["text"])
        if not isinstance(part, dict) or kind != "image_url":
            raise invalid_param(f"{param} must be a text part {{'type': 'text', 'text': ...}} or an "
                                f"image_url part, got type {kind!r}.", param)
        if not self.supports_images:
            raise APIError(400, "The model does not accept images (image_url content parts).",
                           param=param, code="model_does_not_accept_images")
        spec = part.get("image_url")
        url = spec.get("url") if isinstance(spec, dict) else spec
        try:
            data = image_bytes(url, allow_remote=self.allow_remote_images, fetch=self.fetch)
            images.append(_EncodedImage(f"{param}.image_url", data, image_pixels(data)))
        except ValueError as exc:
            raise invalid_param(f"{param}.image_url: {exc}", f"{param}.image_url") from exc
        if self.image_processor is not None:
            return _IMAGE
        assert self.image_placeholder is not None
        return self.image_placeholder.text

    # ----------------------------------------------------------------- images
    def _reserve(self, pixels: int) -> Any:
        """The pixel budget's reservation of ``pixels`` as a context manager, its refusals
        as API errors."""
        if self.pixel_budget is None or not pixels:
            return _nothing()
        return _reservation(self.pixel_budget, pixels)

    @staticmethod
    def _decode(image: _EncodedImage) -> ImageData:
        try:
            return ImageData.from_bytes(image.data)
        except ValueError as exc:
            raise invalid_param(f"{image.param}: {exc}", image.param) from exc

    def _text_only(self, token_ids: list[int]) -> ChatPrompt:
        """A vision-language model's prompt without images: the processor's tokenizer gives
        the same ids, and an image token written in text is refused as the processor would."""
        assert self.image_processor is not None
        found = token_ids.count(self.image_processor.image_token_id)
        if found:
            raise invalid_param(
                f"The images could not be placed in the prompt: the prompt has {found} image tokens but "
                f"no images; do not write the image placeholder {self.image_processor.image_text!r} in text",
                "messages")
        return ChatPrompt(token_ids)

    def _process(self, text: str, images: list[ImageData]) -> ChatPrompt:
        """The checkpoint's processor over the rendered text and the images (its own lock)."""
        assert self.image_processor is not None
        try:
            out = self.image_processor.encode(text, [i.image for i in images], [i.sha256 for i in images])
        except ValueError as exc:
            raise invalid_param(f"The images could not be placed in the prompt: {exc}", "messages") from exc
        return ChatPrompt(out.token_ids, out.items, tuple(images), out.inputs)

    def _expand_images(self, token_ids: list[int], images: list[ImageData]) -> ChatPrompt:
        """Expand each placeholder token to its positions; one MultiModalItem per image, in order."""
        spec = self.image_placeholder
        assert spec is not None
        positions = [i for i, tok in enumerate(token_ids) if tok == spec.token_id]
        if len(positions) != len(images):
            raise invalid_param(
                f"Found {len(positions)} image placeholders in the rendered prompt for "
                f"{len(images)} images; do not write the placeholder {spec.text!r} in text.",
                "messages",
            )
        expanded: list[int] = []
        items: list[MultiModalItem] = []
        start = 0
        for pos, image in zip(positions, images, strict=True):
            expanded.extend(token_ids[start:pos])
            items.append(MultiModalItem(image.sha256, len(expanded), spec.tokens_per_image))
            expanded.extend([spec.token_id] * spec.tokens_per_image)
            start = pos + 1
        expanded.extend(token_ids[start:])
        return ChatPrompt(expanded, tuple(items), tuple(images))


@contextlib.contextmanager
def _nothing() -> Iterator[None]:
    yield


@contextlib.contextmanager
def _reservation(budget: PixelBudget, pixels: int) -> Iterator[None]:
    try:
        budget.acquire(pixels)
    except PixelBudgetTooSmall as exc:
        raise invalid_param(f"The request's images are too large together: {exc}.", "messages",
                            "too_many_image_pixels") from exc
    except PixelBudgetBusy as exc:
        raise APIError(429, f"The engine is busy with other requests' images ({exc}); retry later.",
                       type="requests", code="rate_limit_exceeded") from exc
    try:
        yield
    finally:
        budget.release(pixels)


_IMAGE = "\x00image\x00"
"""What :meth:`ChatRenderer._part` returns for an image part when a processor places images."""


def _as_parts(content: str | list[dict[str, str]]) -> list[dict[str, str]]:
    return content if isinstance(content, list) else [{"type": "text", "text": content}]


def max_token_chars(tokenizer: Any) -> int | None:
    """The most characters of text one token can stand for: its longest vocabulary entry.

    Byte-level entries spell one byte per character and decode to at most as many
    characters; added tokens are their text. So a text of ``c`` characters has at
    least ``c / max_token_chars`` tokens, which lets a prompt be refused by its size
    alone, before it is tokenized. A tokenizer with a normalizer (which may merge
    characters) gets a factor 4 of slack; one without a vocabulary gives None (no bound).
    """
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    if not vocab:
        return None
    longest = max(len(str(entry)) for entry in vocab)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    slack = 4 if backend is not None and getattr(backend, "normalizer", None) is not None else 1
    return max(longest, 1) * slack


def _template_source(tokenizer: Any) -> str:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        return "\n".join(str(t) for t in template.values())
    return template if isinstance(template, str) else ""


def _inline_tools(conversation: list[dict[str, Any]],
                  tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Write tools and tool calls into the text, for templates that ignore them.

    Keys are sorted, as Jinja's ``tojson`` does in templates that render tools, so the
    same tools sent with another key order give the same prompt; tool order is kept.
    """
    block = "\n".join([TOOLS_HEADER, *(json.dumps(t, ensure_ascii=False, sort_keys=True) for t in tools),
                       CALL_INSTRUCTIONS])
    out = [dict(m) for m in conversation]
    for message in out:
        calls = message.pop("tool_calls", None)
        if calls is not None:
            written = calls if isinstance(calls, list) else [calls]
            _append_text(message, PART_JOIN, "\n".join(render_call(c) for c in written))
    if out and out[0]["role"] == "system":
        _append_text(out[0], PART_JOIN + PART_JOIN, block)
    else:
        out.insert(0, {"role": "system", "content": block})
    return out


def _append_text(message: dict[str, Any], joiner: str, text: str) -> None:
    """Append ``text`` to a message's content (after ``joiner`` if it has text already);
    a list of parts gets a new text part."""
    content = message["content"]
    if isinstance(content, list):
        message["content"] = [*content, {"type": "text", "text": text}]
    else:
        message["content"] = content + (joiner if content else "") + text
