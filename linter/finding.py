"""The :class:`Finding`: one problem the linter reports, in a file or an in-memory request.

Invariants: ``severity`` is one of :data:`SEVERITIES`; ``line`` and ``column`` are
1-based or ``None`` (an in-memory request has neither); ``tokens_lost`` is the
estimated number of prompt tokens that could not be served from the prefix cache
because of this finding, or ``None`` when the rule cannot estimate it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

SEVERITIES: tuple[str, ...] = ("info", "warning", "error")
"""Severities from least to most severe."""


def severity_rank(severity: str) -> int:
    """0 for info, 1 for warning, 2 for error; ValueError for anything else."""
    try:
        return SEVERITIES.index(severity)
    except ValueError:
        raise ValueError(f"unknown severity {severity!r}; expected one of {', '.join(SEVERITIES)}") from None


@dataclass(frozen=True)
class Finding:
    """A rule violation at a location."""

    code: str
    severity: str
    message: str
    path: str
    line: int | None
    column: int | None
    location: str
    tokens_lost: int | None = None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict with every field."""
        return asdict(self)

    def sort_key(self) -> tuple[str, int, int, str, str]:
        """Order findings by file, line, column, code and location."""
        return (self.path, self.line or 0, self.column or 0, self.code, self.location)
