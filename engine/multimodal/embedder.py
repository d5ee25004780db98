"""ImageEmbedder: the input embeddings a prefill chunk needs from its request's images.

For a chunk ``[start, end)`` of a prompt, each image whose feature positions fall
partly inside it contributes the rows of its features at those positions, taken
from the :class:`~engine.multimodal.encoder_cache.EncoderCache` (the vision tower runs
on a miss). Chunked prefill may therefore split an image across steps: each step
takes its slice, and the features are encoded once while they stay cached (an
eviction in between only costs a recomputation of the same bits). An image whose
positions all lie in blocks reused from the prefix cache is never encoded: the
engine only asks for the chunks it computes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.multimodal.encoder_cache import EncoderCache
from engine.multimodal.processor import ImageInput
from engine.multimodal.vlm import VisionEncoder


class ImageEmbedder:
    """A vision encoder behind an encoder cache."""

    def __init__(self, encoder: VisionEncoder, cache: EncoderCache) -> None:
        self.encoder = encoder
        self.cache = cache

    def features(self, image: ImageInput, cache_salt: str | None) -> torch.Tensor:
        """``[len(image.positions), hidden]`` features of ``image``; ValueError when the
        vision tower gives another number of rows than the image has placeholder tokens."""
        def compute() -> torch.Tensor:
            out = self.encoder.encode(image.pixels)
            if out.shape[0] != image.positions.numel():
                raise ValueError(
                    f"image {image.identifier[:16]} has {image.positions.numel()} placeholder tokens "
                    f"but {out.shape[0]} feature rows"
                )
            return out

        return self.cache.get_or_compute((cache_salt, image.identifier), compute)

    def embeds(
        self, images: Sequence[ImageInput], cache_salt: str | None, start: int, end: int
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(rows, values)`` pairs for chunk ``[start, end)``: ``rows`` relative to ``start``."""
        out: list[tuple[torch.Tensor, torch.Tensor]] = []
        for image in images:
            pos = image.positions
            if int(pos[-1]) < start or int(pos[0]) >= end:
                continue
            inside = (pos >= start) & (pos < end)
            out.append((pos[inside] - start, self.features(image, cache_salt)[inside]))
        return out
