"""What a per-request finding costs: the shared-prefix tokens after it.

A value inside the static prefix (the tools, ``tool_choice``,
``response_format`` and leading instructions every request of a family repeats)
makes everything from that value to the end of the static prefix unshareable
between requests. :func:`static_tokens_lost` counts those tokens, in full
blocks, for a finding located at ``messages[i].content[START:END]`` (or
``...content[j].text[START:END]``, or ``...[OFFSET]``). Findings elsewhere (in the
tools' JSON, after the static prefix) get None: the cross-request rules and the
hit-rate table measure them.
"""

from __future__ import annotations

import re

from linter.render import Rendered
from linter.tokenizer import ApproxTokenizer, Tokenizer

_LOCATION = re.compile(r"^(?P<path>messages\[\d+\]\.content(?:\[\d+\]\.text)?)\[(?P<start>\d+)(?::\d+)?\]$")


def _tokens_before(rendered: Rendered, index: int, chars: int, tokenizer: Tokenizer) -> int:
    """Tokens of ``rendered.parts[:index]`` plus the first ``chars`` characters of part ``index``."""
    if isinstance(tokenizer, ApproxTokenizer):
        return len(tokenizer.encode_parts(rendered.parts[:index])) + len(tokenizer.encode(rendered.parts[index][:chars]))
    start = rendered.ends[index - 1] if index else 0
    return len(tokenizer.encode(rendered.text[: start + chars]))


def static_tokens_lost(rendered: Rendered, location: str, tokenizer: Tokenizer, block_size: int) -> int | None:
    """Full-block tokens of the static prefix from ``location`` on, or None (see the module docstring)."""
    match = _LOCATION.match(location)
    if match is None:
        return None
    try:
        index = rendered.locations.index(match.group("path"))
    except ValueError:
        return None
    if index >= rendered.static_parts:
        return None
    before = _tokens_before(rendered, index, int(match.group("start")), tokenizer)
    total = _tokens_before(rendered, rendered.static_parts, 0, tokenizer) if rendered.static_parts < len(rendered.parts) else None
    if total is None:
        return None
    return max(0, (total // block_size - before // block_size) * block_size)
