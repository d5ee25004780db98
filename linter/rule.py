"""The :class:`Rule`: one check, its metadata and its documentation.

Every rule lives in its own module ``linter/rules/<code>.py`` whose docstring is
the rule's documentation (why it matters, an anti-pattern, the better pattern) and
which defines ``RULE``. A rule has one scope:

* ``request`` (PS1xx): ``check_request(body, options)`` yields :class:`Hit` objects
  for one chat-completions body;
* ``corpus`` (PS2xx): produced by :mod:`linter.divergence` when two requests that
  should share a prefix diverge; the module holds documentation (and a fix);
* ``source`` (PS3xx): ``check_source(tree, options)`` yields hits for a Python AST.

``default`` says whether the rule is in the default selection. Default rules
report only breaks that happened in the input (measured by comparing requests)
or that are certain by construction (a volatile value inside the instructions);
the others are hygiene checks, selected explicitly (``--select``,
``--extend-select``), that also report consistent but non-canonical input.

``fix(body)`` (optional) returns the body as it would be with the rule's advice
applied (the same object when nothing changes); the hit-rate estimate replays the
corpus through it.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

Body = Mapping[str, Any]


@dataclass(frozen=True)
class Options:
    """Per-run knobs the rules read."""

    allowlist: tuple[str, ...] = ()
    source_path: str | None = None  # the file a source rule checks (its sibling modules are followed)


@dataclass(frozen=True)
class Hit:
    """A rule's raw result before it becomes a :class:`~linter.finding.Finding`.

    ``location`` is a JSON path (requests) or empty (source); ``needle`` is text to
    search for in the raw input line to compute a column; ``line``/``column`` are
    set directly by source rules.
    """

    message: str
    location: str = ""
    needle: str | None = None
    line: int | None = None
    column: int | None = None
    tokens_lost: int | None = None


RequestCheck = Callable[[Body, Options], Iterable[Hit]]
SourceCheck = Callable[[ast.Module, Options], Iterable[Hit]]
Fix = Callable[[Body], Body]


@dataclass(frozen=True)
class Rule:
    """A rule's code, name, default severity, scope, one-line summary and documentation."""

    code: str
    name: str
    severity: str
    scope: str
    summary: str
    doc: str
    check_request: RequestCheck | None = field(default=None, compare=False)
    check_source: SourceCheck | None = field(default=None, compare=False)
    fix: Fix | None = field(default=None, compare=False)
    fix_everywhere: bool = False  # apply the fix to every request, not only where findings are
    default: bool = True  # in the default selection (see the module docstring)

    def __post_init__(self) -> None:
        assert self.scope in ("request", "corpus", "source"), self.scope
        assert self.severity in ("info", "warning", "error"), self.severity
        assert self.doc.strip(), f"{self.code} needs a docstring"
