"""Configuration: ``[tool.prefixgate.lint]`` in pyproject.toml, merged with command-line options.

Keys (all optional)::

    [tool.prefixgate.lint]
    select = ["PS1", "PS2", "PS301"]      # codes or prefixes; default: the default rules
    extend-select = ["PS104"]             # added to select (opt-in hygiene rules)
    ignore = ["PS106"]
    fail-on = "warning"                     # error | warning | info | never
    allowlist = ["^2024-01-01$"]            # regexes of volatile-looking values to accept
    block-size = 16
    cache-blocks = 100000                   # LRU capacity of the replay, in blocks
    tokenizer = "bundled"                   # or a tokenizer.json path
    baseline = "prefixgate-baseline.json"
    exclude = ["test_*.py", "*_test.py", "tests/*", "conftest.py"]   # the default
    extend-exclude = ["vendor/*"]

    [tool.prefixgate.lint.per-file-ignores]
    "examples/legacy/*.py" = ["PS305"]

    [tool.prefixgate.lint.severity]
    PS104 = "error"

Unknown keys, unknown codes and wrong types raise ValueError (exit code 2 in the
CLI). Command-line ``--select``/``--extend-select``/``--ignore`` replace/extend
the file's values. ``exclude`` (glob patterns over the path or the file name)
skips Python files found in directories: test files by default, like a
per-file ignore of every source rule; a file named on the command line is
always linted.
"""

from __future__ import annotations

import fnmatch
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.contract.limits import BLOCK_SIZE
from linter.finding import SEVERITIES
from linter.registry import default_codes, expand_codes

FAIL_ON = (*SEVERITIES, "never")
_KEYS = {
    "select", "extend-select", "ignore", "fail-on", "allowlist", "block-size", "cache-blocks", "tokenizer",
    "baseline", "per-file-ignores", "severity", "exclude", "extend-exclude",
}
DEFAULT_EXCLUDE: tuple[str, ...] = ("test_*.py", "*_test.py", "tests/*", "*/tests/*", "conftest.py")


@dataclass
class LintConfig:
    select: set[str] = field(default_factory=default_codes)
    ignore: set[str] = field(default_factory=set)
    fail_on: str = "warning"
    allowlist: tuple[str, ...] = ()
    block_size: int = BLOCK_SIZE
    cache_blocks: int | None = None
    tokenizer: str | None = None
    baseline: str | None = None
    per_file_ignores: dict[str, set[str]] = field(default_factory=dict)
    severity: dict[str, str] = field(default_factory=dict)
    exclude: tuple[str, ...] = DEFAULT_EXCLUDE
    source: str | None = None  # the pyproject.toml it came from

    def enabled(self) -> set[str]:
        return self.select - self.ignore

    def ignored_for(self, path: str) -> set[str]:
        posix = Path(path).as_posix()
        out: set[str] = set()
        for pattern, codes in self.per_file_ignores.items():
            if fnmatch.fnmatch(posix, pattern) or fnmatch.fnmatch(Path(path).name, pattern):
                out |= codes
        return out

    def excludes(self, path: Path) -> bool:
        """Whether a Python file found in a directory is skipped (``exclude`` patterns)."""
        posix = path.as_posix()
        return any(fnmatch.fnmatch(posix, p) or fnmatch.fnmatch(path.name, p) for p in self.exclude)

    def severity_of(self, code: str, default: str) -> str:
        return self.severity.get(code, default)


def find_pyproject(start: Path) -> Path | None:
    """The nearest pyproject.toml at or above ``start`` that has a ``[tool.prefixgate.lint]`` table."""
    for directory in (start, *start.parents):
        candidate = directory / "pyproject.toml"
        if candidate.is_file():
            try:
                data = tomllib.loads(candidate.read_text(encoding="utf-8"))
            except (OSError, tomllib.TOMLDecodeError):
                continue
            if isinstance(data.get("tool", {}).get("prefixgate", {}).get("lint"), Mapping):
                return candidate
    return None


def _int(value: Any, key: str, minimum: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"[tool.prefixgate.lint] {key} must be an integer >= {minimum}, got {value!r}")
    return value


def _strings(value: Any, key: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"[tool.prefixgate.lint] {key} must be a list of strings, got {value!r}")
    return value


def from_table(table: Mapping[str, Any], source: str | None = None) -> LintConfig:
    """A config from a ``[tool.prefixgate.lint]`` table; ValueError names the bad key."""
    unknown = set(table) - _KEYS
    if unknown:
        raise ValueError(f"unknown key(s) in [tool.prefixgate.lint]: {', '.join(sorted(unknown))}")
    config = LintConfig(source=source)
    if "select" in table:
        config.select = expand_codes(_strings(table["select"], "select"))
    if "extend-select" in table:
        config.select |= expand_codes(_strings(table["extend-select"], "extend-select"))
    if "ignore" in table:
        config.ignore = expand_codes(_strings(table["ignore"], "ignore"))
    if "exclude" in table:
        config.exclude = tuple(_strings(table["exclude"], "exclude"))
    if "extend-exclude" in table:
        config.exclude += tuple(_strings(table["extend-exclude"], "extend-exclude"))
    if "fail-on" in table:
        config.fail_on = check_fail_on(table["fail-on"])
    if "allowlist" in table:
        config.allowlist = tuple(_strings(table["allowlist"], "allowlist"))
        for pattern in config.allowlist:
            try:
                re.compile(pattern)
            except re.error as exc:
                raise ValueError(f"invalid allowlist pattern {pattern!r}: {exc}") from None
    if "block-size" in table:
        config.block_size = _int(table["block-size"], "block-size", 1)
    if "cache-blocks" in table:
        config.cache_blocks = _int(table["cache-blocks"], "cache-blocks", 1)
    for key in ("tokenizer", "baseline"):
        if key in table:
            if not isinstance(table[key], str):
                raise ValueError(f"[tool.prefixgate.lint] {key} must be a string, got {table[key]!r}")
            setattr(config, key, table[key])
    pfi = table.get("per-file-ignores", {})
    if not isinstance(pfi, Mapping):
        raise ValueError(f"[tool.prefixgate.lint] per-file-ignores must be a table, got {pfi!r}")
    config.per_file_ignores = {str(k): expand_codes(_strings(v, f"per-file-ignores.{k}")) for k, v in pfi.items()}
    severity = table.get("severity", {})
    if not isinstance(severity, Mapping):
        raise ValueError(f"[tool.prefixgate.lint] severity must be a table, got {severity!r}")
    for code, level in severity.items():
        codes = expand_codes([code])
        if len(codes) != 1:
            raise ValueError(f"[tool.prefixgate.lint] severity keys must be single rule codes, got {code!r}")
        if level not in SEVERITIES:
            raise ValueError(f"[tool.prefixgate.lint] severity.{code} must be one of {', '.join(SEVERITIES)}, got {level!r}")
        config.severity[codes.pop()] = level
    return config


def check_fail_on(value: Any) -> str:
    if value not in FAIL_ON:
        raise ValueError(f"fail-on must be one of {', '.join(FAIL_ON)}, got {value!r}")
    return str(value)


def load_config(path: Path | None, start: Path) -> LintConfig:
    """The config in ``path`` (explicit) or the nearest pyproject.toml; defaults when none."""
    pyproject = path if path is not None else find_pyproject(start)
    if pyproject is None:
        return LintConfig()
    try:
        data = tomllib.loads(pyproject.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ValueError(f"cannot read config {str(pyproject)!r}: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"invalid TOML in {str(pyproject)!r}: {exc}") from None
    table = data.get("tool", {}).get("prefixgate", {}).get("lint", {})
    if not isinstance(table, Mapping):
        raise ValueError(f"[tool.prefixgate.lint] in {pyproject} must be a table")
    return from_table(table, str(pyproject))
