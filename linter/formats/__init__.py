"""Output formats of ``prefixgate lint``: one module per format, each with ``render(report, ...) -> str``."""

from __future__ import annotations

from collections.abc import Callable

from linter.formats import github, json_format, junit, sarif, text
from linter.runner import LintReport

Renderer = Callable[[LintReport, bool, bool], str]

FORMATS: dict[str, Renderer] = {
    "text": text.render,
    "json": json_format.render,
    "sarif": sarif.render,
    "github": github.render,
    "junit": junit.render,
}
