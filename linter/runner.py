"""One lint run: collect files, run the request, cross-request and source rules, estimate.

Flow: :func:`collect_paths` splits the inputs into request logs (.json, .jsonl,
.ndjson) and Python sources (.py); request records are checked one by one
(PS1xx), then fed in order to :class:`~linter.request_families.RequestFamilies`
(PS2xx); sources go through :func:`~linter.source_file.lint_source` (PS3xx).
Per-file ignores, severity overrides and the baseline are applied to the
findings; finally the corpus is replayed for the hit-rate estimate with the
fixes of every rule that found something.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from linter.baseline import filter_baseline, load_baseline
from linter.config import LintConfig
from linter.corpus import REQUEST_SUFFIXES, LoadProblem, Record, load_file
from linter.estimate import Estimate, estimate
from linter.finding import Finding
from linter.gateway_log import TenantStats
from linter.registry import all_rules
from linter.request_families import RequestFamilies
from linter.rule import Fix, Options, Rule
from linter.source_file import lint_source
from linter.tokenizer import Tokenizer

_SKIP_DIRS = {".git", ".venv", "venv", "node_modules", "__pycache__", ".mypy_cache", ".ruff_cache", ".pytest_cache"}


@dataclass
class LintReport:
    findings: list[Finding]
    problems: list[LoadProblem]
    estimate: Estimate | None
    rules: list[Rule]
    files: int
    baselined: int = 0
    all_findings: list[Finding] = field(default_factory=list)  # before the baseline
    gateway_log: list[TenantStats] | None = None  # from --db


def collect_paths(paths: Sequence[Path]) -> tuple[list[Path], list[Path]]:
    """(request files, Python files); ValueError for a missing path or unsupported file."""
    requests: list[Path] = []
    sources: list[Path] = []
    for path in paths:
        if path.is_dir():
            for child in sorted(path.rglob("*")):
                if any(part in _SKIP_DIRS or part.startswith(".") for part in child.relative_to(path).parts):
                    continue
                if child.is_file() and child.suffix in REQUEST_SUFFIXES:
                    requests.append(child)
                elif child.is_file() and child.suffix == ".py":
                    sources.append(child)
        elif path.is_file():
            if path.suffix in REQUEST_SUFFIXES:
                requests.append(path)
            elif path.suffix == ".py":
                sources.append(path)
            else:
                raise ValueError(f"unsupported input {str(path)!r}: expected .json, .jsonl, .ndjson or .py")
        else:
            raise ValueError(f"input {str(path)!r} does not exist")
    return requests, sources


def _request_findings(records: Sequence[Record], rules: Sequence[Rule], options: Options) -> list[Finding]:
    findings: list[Finding] = []
    for record in records:
        for rule in rules:
            assert rule.check_request is not None
            for hit in rule.check_request(record.body, options):
                line, column = record.locate(hit.needle)
                findings.append(Finding(rule.code, rule.severity, hit.message, record.path, line, column, hit.location, hit.tokens_lost))
    return findings


def _corpus_findings(records: Sequence[Record], enabled: set[str], config: LintConfig, tokenizer: Tokenizer) -> list[Finding]:
    rules = all_rules()
    families = RequestFamilies(tokenizer, allowlist=config.allowlist, block_size=config.block_size)
    findings: list[Finding] = []
    for record in records:
        found = families.add(record.body)
        if found is None or found.code not in enabled:
            continue
        line, column = record.locate(found.needle)
        rule = rules[found.code]
        findings.append(Finding(rule.code, rule.severity, found.message, record.path, line, column, found.location, found.tokens_lost))
    return findings


def _configure(findings: list[Finding], config: LintConfig) -> list[Finding]:
    out: list[Finding] = []
    for finding in findings:
        if finding.code in config.ignored_for(finding.path):
            continue
        severity = config.severity_of(finding.code, finding.severity)
        out.append(finding if severity == finding.severity else replace(finding, severity=severity))
    return sorted(out, key=Finding.sort_key)


def lint_paths(
    paths: Sequence[Path],
    config: LintConfig,
    tokenizer: Tokenizer,
    *,
    baseline: Path | None = None,
    with_estimate: bool = True,
) -> LintReport:
    """Run every enabled rule on ``paths`` (see the module docstring)."""
    request_files, source_files = collect_paths(paths)
    enabled = config.enabled()
    rules = [r for code, r in all_rules().items() if code in enabled]
    options = Options(allowlist=config.allowlist)
    problems: list[LoadProblem] = []
    records = [record for path in request_files for record in load_file(path, problems)]
    findings = _request_findings(records, [r for r in rules if r.check_request is not None], options)
    if any(r.scope == "corpus" for r in rules):
        findings += _corpus_findings(records, enabled, config, tokenizer)
    source_rules = [r for r in rules if r.check_source is not None]
    for path in source_files:
        findings += lint_source(path, source_rules, options, problems)
    findings = _configure(findings, config)
    report = LintReport(findings, problems, None, rules, len(request_files) + len(source_files), all_findings=findings)
    if baseline is not None:
        report.findings = filter_baseline(findings, load_baseline(baseline))
        report.baselined = len(findings) - len(report.findings)
    if with_estimate and records:
        found_codes = {f.code for f in findings}
        fixes: dict[str, Fix] = {r.code: r.fix for r in rules if r.fix is not None and r.code in found_codes}
        report.estimate = estimate(
            [r.body for r in records], fixes, tokenizer, block_size=config.block_size, capacity_blocks=config.cache_blocks
        )
    return report
