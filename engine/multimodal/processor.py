"""ImagePromptProcessor: a rendered chat and its images -> token ids, placeholder ranges, pixels.

The checkpoint's processor is the source of truth for how many placeholder tokens an
image takes (LLaVA: a fixed count; Idefics3: one run per tile plus a global view,
so the count depends on the image's size). The whole text with all its images goes
through the processor once; its ``input_ids`` are the prompt. Each image also goes
through the processor alone (text: one image token), which yields that image's pixel
inputs and its number of feature tokens; the prompt's image-token positions are then
assigned to the images in order.

Invariants of :meth:`ImagePromptProcessor.encode`'s result:

* ``inputs[i].positions`` are exactly the positions of the image token id that belong
  to image ``i``, ascending; together, in order, they are all the image-token
  positions of the prompt;
* ``items[i]`` spans ``positions[0] .. positions[-1]`` of image ``i`` (tile
  separators in between included), named by the image's content hash, so every block
  the image's tokens touch carries it in its hash.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from engine.kvcache.block_hash import MultiModalItem


@dataclass(frozen=True, eq=False)
class ImageInput:
    """One image of a prompt as the engine needs it: its content hash (the
    :class:`MultiModalItem` identifier), the prompt positions its features go to,
    and its pixel inputs for :class:`~engine.multimodal.vlm.VisionEncoder`."""

    identifier: str
    positions: torch.Tensor
    pixels: dict[str, torch.Tensor]

    @property
    def item(self) -> MultiModalItem:
        first, last = int(self.positions[0]), int(self.positions[-1])
        return MultiModalItem(self.identifier, first, last - first + 1)


@dataclass(frozen=True)
class ProcessedPrompt:
    token_ids: list[int]
    items: tuple[MultiModalItem, ...]
    inputs: tuple[ImageInput, ...]


class ImagePromptProcessor:
    """Wraps a transformers processor (``LlavaProcessor``, ``Idefics3Processor``).

    Thread-safe: it works on a private copy of the processor (its own tokenizer,
    which HF does not allow to share between threads) under its own lock, so the
    chat renderer's tokenizer, the same checkpoint's, stays free for text while
    images are processed."""

    def __init__(self, processor: Any) -> None:
        self.processor = copy.deepcopy(processor)
        self._lock = threading.Lock()
        self.image_text = str(processor.image_token)
        self.image_token_id = int(processor.tokenizer.convert_tokens_to_ids(self.image_text))
        self.nested = type(processor).__name__ == "Idefics3Processor"  # images per text sample
        template = getattr(processor, "chat_template", None)
        self.chat_template: str | None = template if isinstance(template, str) else None

    def _call(self, text: str, images: Sequence[Any]) -> Any:
        with self._lock:
            return self._call_locked(text, images)

    def _call_locked(self, text: str, images: Sequence[Any]) -> Any:
        batch: Any = None
        if images:
            batch = [list(images)] if self.nested else list(images)
        # numpy, not torch: this runs on a server thread, and a torch copy there would start
        # a second OpenMP pool next to the engine thread's (see LLMEngine.launch); the
        # arrays become tensors below without a copy.
        return self.processor(text=[text], images=batch, add_special_tokens=False, return_tensors="np")

    def encode(self, text: str, images: Sequence[Any], identifiers: Sequence[str]) -> ProcessedPrompt:
        """Process ``text`` (which holds one :attr:`image_text` per image, in order) with
        ``images`` (PIL images) named by ``identifiers``; ValueError when they disagree."""
        if len(images) != len(identifiers):
            raise ValueError(f"{len(images)} images but {len(identifiers)} identifiers")
        out = self._call(text, images)
        token_ids = [int(t) for t in out["input_ids"][0].tolist()]
        positions = [i for i, t in enumerate(token_ids) if t == self.image_token_id]
        inputs: list[ImageInput] = []
        taken = 0
        for image, identifier in zip(images, identifiers, strict=True):
            alone = self._call(self.image_text, [image])
            count = sum(1 for t in alone["input_ids"][0].tolist() if t == self.image_token_id)
            mine = positions[taken : taken + count]
            if count < 1 or len(mine) != count:
                raise ValueError(f"the prompt has {len(positions)} image tokens, fewer than its images need")
            taken += count
            pixels = {k: torch.from_numpy(v) for k, v in alone.items() if k not in ("input_ids", "attention_mask")
                      and isinstance(v, np.ndarray)}
            inputs.append(ImageInput(identifier, torch.tensor(mine, dtype=torch.long), pixels))
        if taken != len(positions):
            raise ValueError(
                f"the prompt has {len(positions)} image tokens but its {len(images)} images take {taken}; "
                f"do not write the image placeholder {self.image_text!r} in text"
            )
        return ProcessedPrompt(token_ids, tuple(i.item for i in inputs), tuple(inputs))
