"""PS207 image-changed: two requests that should share a prefix first differ at an image.

Why it matters
    An engine caches an image's blocks under the image's content hash: a later
    turn reuses them only if it sends the same picture at the same place. Sending
    a re-rendered screenshot, a resized or re-compressed copy, or dropping an image
    from the history shifts or changes everything from that image on, and every
    block from there is recomputed (the image's own tokens included, often
    hundreds).

Anti-pattern
    turn 1: [text "what is on this page?", image screenshot-v1.png]
    turn 2: [text "what is on this page?", image screenshot-v2.png], ...

Better
    Keep the images of earlier turns byte for byte (or at least pixel for pixel:
    the same pixels re-encoded as PNG or lossless WebP hash alike), and send a new
    image in the newest message instead of replacing an old one.

Reported at the image part of the later request (or of the earlier one when it
was removed); ``tokens_lost`` counts the full 16-token blocks of the earlier prompt
that were not reused, an image counting OpenAI's tile estimate (85 tokens at
``detail: "low"``, else 85 + 170 per 512-pixel tile after scaling; see
``linter/image_parts.py``). Images are compared by the engine's content hash of
their pixels where Pillow is installed, else by their encoded bytes; remote URLs
by the URL.
"""

from __future__ import annotations

from linter.rule import Rule

RULE = Rule(
    code="PS207",
    name="image-changed",
    severity="warning",
    scope="corpus",
    summary="Requests that should share a prefix first differ at an image",
    doc=__doc__ or "",
)
