"""PmlCompiler: PML text in, compiled schemas and SegmentedPrompts out, for one tokenizer.

The entry points of the PML package: :meth:`PmlCompiler.schema` reads
(:mod:`~engine.promptcache.pml_syntax`) and compiles
(:mod:`~engine.promptcache.pml_schema`) a ``<schema>``; :meth:`PmlCompiler.prompt`
compiles a ``<prompt>`` (:mod:`~engine.promptcache.pml_prompt`) against schemas
found by a lookup (the caller's registry, already scoped to one cache salt). Every
refusal is a :class:`~engine.promptcache.pml_syntax.PmlError` (a ValueError) naming
the line and column.

``tokenizer`` is anything with ``encode(text, add_special_tokens=...)`` and, for
role tags, ``apply_chat_template`` (a ``transformers`` tokenizer, or the gateway's
:class:`~engine.contract.chat_tokenizer.ChatTokenizer`). Thread-safe: the role
template is computed once, under a lock; compiling keeps no state between calls.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine.promptcache.chat_roles import RoleTemplate, role_template
from engine.promptcache.pml_prompt import PromptBuilder
from engine.promptcache.pml_schema import CompiledSchema, SchemaBuilder
from engine.promptcache.pml_syntax import parse_pml
from engine.promptcache.segments import Recovery, SegmentedPrompt

DEFAULT_MAX_MODULES = 256
DEFAULT_MAX_SCHEMA_TOKENS = 131072


@dataclass(frozen=True)
class PmlLimits:
    """Bounds of one schema: modules, module tokens, and the largest param ``len``
    (at most the model's context: ``max_model_len``)."""

    max_param_tokens: int
    max_modules: int = DEFAULT_MAX_MODULES
    max_schema_tokens: int = DEFAULT_MAX_SCHEMA_TOKENS


class PmlCompiler:
    """Compiles PML for one tokenizer (see the module docstring)."""

    def __init__(self, tokenizer: Any, limits: PmlLimits, tokenizer_lock: threading.Lock | None = None) -> None:
        """``tokenizer_lock``: held around every tokenizer call (shared with the tokenizer's
        other users in the process)."""
        self.tokenizer = tokenizer
        self.limits = limits
        self._lock = threading.Lock()
        self._tokenizer_lock = tokenizer_lock or threading.Lock()
        self._roles: RoleTemplate | ValueError | None = None
        with self._tokenizer_lock:
            self.leading = tuple(int(t) for t in tokenizer.encode("", add_special_tokens=True))
            self._leading_text = str(tokenizer.decode(list(self.leading))) if self.leading else ""

    def encode(self, text: str) -> list[int]:
        """Token ids of a piece of text, without special tokens added."""
        if not text:
            return []
        with self._tokenizer_lock:
            return [int(t) for t in self.tokenizer.encode(text, add_special_tokens=False)]

    def roles(self) -> RoleTemplate:
        """The chat template's role glue; ValueError when the template cannot be split."""
        with self._lock:
            if self._roles is None:
                try:
                    with self._tokenizer_lock:
                        self._roles = role_template(self.tokenizer, self._leading_text)
                except ValueError as exc:
                    self._roles = exc
            if isinstance(self._roles, ValueError):
                raise ValueError(str(self._roles))
            return self._roles

    def schema(self, source: str) -> CompiledSchema:
        """A compiled ``<schema>``; PmlError for anything wrong with it."""
        builder = SchemaBuilder(self.encode, self.roles, max_modules=self.limits.max_modules,
                                max_tokens=self.limits.max_schema_tokens,
                                max_param_tokens=self.limits.max_param_tokens)
        return builder.build(parse_pml(source))

    def prompt(self, source: str, schemas: Callable[[str], CompiledSchema | None],
               recovery: Recovery | None = None) -> SegmentedPrompt:
        """A ``<prompt>`` as a SegmentedPrompt; ``schemas`` finds a schema by name."""
        builder = PromptBuilder(self.encode, self.roles, self.leading, schemas)
        return builder.build(parse_pml(source), recovery or Recovery())
