"""SegmentedPrompt: a prompt cut into runs, some of which may reuse KV computed on their own.

This is the contract between whoever builds a prompt from parts (the PML compiler,
``segment_reuse`` for chat messages) and the engine, which owns the KV. A
:class:`Segment` with a ``module`` name is *position-independent*: its KV may come
from the module store, computed once for the same tokens on their own and moved
(keys re-rotated) to wherever the segment sits in this prompt. A segment without a
module is computed for this request, attending to everything before it.

Reuse is approximate (the module's tokens did not attend to what precedes them
here); :class:`Recovery` says how much of it to recompute. Module reuse is only
ever applied to a request that carries a SegmentedPrompt: a plain request is
computed exactly as before, and KV built from modules is never shared with, or
found by, an exact request.

Invariants:

* ``token_ids`` is the concatenation of the segments' tokens, the request's whole
  prompt; no segment is empty;
* a module's identity is ``(cache salt, module, token_ids)``: the engine adds the
  salt and the model, so equal names with different tokens never share KV.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

RecoveryMode = Literal["none", "epic", "cacheblend"]
RECOVERY_MODES: tuple[RecoveryMode, ...] = ("none", "epic", "cacheblend")
MAX_MODULE_NAME_CHARS = 512


@dataclass(frozen=True)
class Segment:
    """A run of prompt tokens; ``module`` names a reusable one (for example
    ``"schema/module"`` or ``"segment"``), None a run computed for this request."""

    token_ids: tuple[int, ...]
    module: str | None = None

    def __post_init__(self) -> None:
        if not self.token_ids:
            raise ValueError("a segment must hold at least one token")
        if self.module is not None and (not self.module or len(self.module) > MAX_MODULE_NAME_CHARS):
            raise ValueError(f"module must be a non-empty name of at most {MAX_MODULE_NAME_CHARS} characters, "
                             f"got {self.module!r:.80}")


@dataclass(frozen=True)
class Recovery:
    """How much of reused module KV to recompute at its new place.

    ``none``: nothing (the paper); ``epic``: the first ``first_tokens`` and the last
    ``last_tokens`` tokens (the boundary into the next segment) of every reused
    module; ``cacheblend`` (the default): the ``fraction`` of module tokens whose
    layer-1 K/V deviate most from what this prompt's context gives them (measured by
    a probe of the first two layers, :mod:`engine.core.module_assembler`).

    The default is measured (docs/engine.md, "Prompt modules"): ``epic`` with 2 first
    tokens is as good for the first token at ~1k tokens of modules (81 of 100 against
    83) at 3x the speed, but at ~4k tokens (16 modules) it agrees on 4 of 10 first
    tokens against ``cacheblend`` 0.1's 7 of 10, its KL 0.80 against 0.24."""

    mode: RecoveryMode = "cacheblend"
    first_tokens: int = 16
    fraction: float = 0.1
    last_tokens: int = 0

    def __post_init__(self) -> None:
        if self.mode not in RECOVERY_MODES:
            raise ValueError(f"recovery mode must be one of {', '.join(RECOVERY_MODES)}, got {self.mode!r}")
        if not isinstance(self.first_tokens, int) or self.first_tokens < 0:
            raise ValueError(f"first_tokens must be an integer >= 0, got {self.first_tokens!r}")
        if not isinstance(self.last_tokens, int) or self.last_tokens < 0:
            raise ValueError(f"last_tokens must be an integer >= 0, got {self.last_tokens!r}")
        if not 0.0 <= self.fraction <= 1.0:
            raise ValueError(f"fraction must be within [0, 1], got {self.fraction!r}")


@dataclass(frozen=True)
class SegmentedPrompt:
    """A whole prompt as segments, with the recovery to apply to its reused modules."""

    segments: tuple[Segment, ...]
    recovery: Recovery = Recovery()

    def __post_init__(self) -> None:
        if not self.segments:
            raise ValueError("a segmented prompt needs at least one segment")

    @property
    def token_ids(self) -> list[int]:
        """The prompt: every segment's tokens, in order."""
        return [t for seg in self.segments for t in seg.token_ids]

    @property
    def num_module_tokens(self) -> int:
        """Tokens in segments that may reuse module KV."""
        return sum(len(s.token_ids) for s in self.segments if s.module is not None)
