"""One lint run: collect files, run the request, cross-request and source rules, estimate.

Flow: :func:`collect_paths` splits the inputs into request logs (.json, .jsonl,
.ndjson) and Python sources (.py). Request records go through one pass in file
order: each is checked (PS1xx), rendered once, fed to
:class:`~linter.request_families.RequestFamilies` (PS2xx) and tokenized into its
block hashes. Sources go through :func:`~linter.source_file.lint_source`
(PS3xx). Per-file ignores, severity overrides and the baseline are applied to
the findings; finally the corpus is replayed for the hit-rate estimate with the
fix of every rule that found something, applied to the records where a rule with
that fix found something (or to every record for fixes marked ``fix_everywhere``,
which repair a difference between requests rather than inside one).
"""

from __future__ import annotations

import gc
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from linter.baseline import filter_baseline, load_baseline
from linter.config import LintConfig
from linter.corpus import REQUEST_SUFFIXES, LoadProblem, Record, load_file
from linter.estimate import Estimate, Prompt, Prompts, estimate
from linter.finding import Finding
from linter.gateway_log import TenantStats
from linter.prefix_cost import static_tokens_lost
from linter.registry import all_rules
from linter.render import render
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


class _RecordPass:
    """One pass over the records: per-request rules, cross-request rules, base prompts.

    Each record is rendered once; ``codes[i]`` collects the codes found on record
    ``i`` (the estimate applies a rule's fix where its findings are).
    """

    def __init__(self, rules: Sequence[Rule], config: LintConfig, tokenizer: Tokenizer, with_estimate: bool) -> None:
        self.request_rules = [r for r in rules if r.check_request is not None]
        self.enabled = {r.code for r in rules}
        self.options = Options(allowlist=config.allowlist)
        self.families = (
            RequestFamilies(tokenizer, allowlist=config.allowlist, block_size=config.block_size)
            if any(r.scope == "corpus" for r in rules)
            else None
        )
        self.prompts = Prompts(tokenizer, config.block_size) if with_estimate else None
        self.tokenizer = tokenizer
        self.block_size = config.block_size
        self.findings: list[Finding] = []
        self.codes: list[set[str]] = []
        self.base: list[Prompt] = []

    def add(self, record: Record) -> None:
        codes: set[str] = set()
        rendered = render(record.body)
        for rule in self.request_rules:
            assert rule.check_request is not None
            for hit in rule.check_request(record.body, self.options):
                line, column = record.locate(hit.needle)
                lost = static_tokens_lost(rendered, hit.location, self.tokenizer, self.block_size)
                self.findings.append(Finding(rule.code, rule.severity, hit.message, record.path, line, column, hit.location, lost))
                codes.add(rule.code)
        if self.families is not None:
            found = self.families.add(record.body, rendered)
            if found is not None and found.code in self.enabled:
                rule = all_rules()[found.code]
                line, column = record.locate(found.needle)
                self.findings.append(Finding(rule.code, rule.severity, found.message, record.path, line, column, found.location, found.tokens_lost))
                codes.add(rule.code)
        self.codes.append(codes)
        if self.prompts is not None:
            self.base.append(self.prompts.of_rendered(rendered))


def _targets(rules: Sequence[Rule], fixes: dict[str, Fix], codes: Sequence[set[str]]) -> dict[str, set[int] | None]:
    """Records each fix applies to: everywhere, or where a rule with the same fix found something."""
    by_code = {r.code: r for r in rules}
    targets: dict[str, set[int] | None] = {}
    for code, fix in fixes.items():
        if by_code[code].fix_everywhere:
            targets[code] = None
            continue
        same = {c for c, f in fixes.items() if f is fix}
        targets[code] = {i for i, found in enumerate(codes) if found & same}
    return targets


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
    """Run every enabled rule on ``paths`` (see the module docstring).

    The cyclic garbage collector is paused meanwhile: a large log creates
    millions of long-lived acyclic objects (bodies, token ids, block hashes) that
    full collections would rescan again and again for nothing.
    """
    paused = gc.isenabled()
    gc.disable()
    try:
        return _lint_paths(paths, config, tokenizer, baseline=baseline, with_estimate=with_estimate)
    finally:
        if paused:
            gc.enable()


def _lint_paths(
    paths: Sequence[Path],
    config: LintConfig,
    tokenizer: Tokenizer,
    *,
    baseline: Path | None,
    with_estimate: bool,
) -> LintReport:
    request_files, source_files = collect_paths(paths)
    enabled = config.enabled()
    rules = [r for code, r in all_rules().items() if code in enabled]
    problems: list[LoadProblem] = []
    records = [record for path in request_files for record in load_file(path, problems)]
    run = _RecordPass(rules, config, tokenizer, with_estimate and bool(records))
    for record in records:
        run.add(record)
    findings = run.findings
    source_rules = [r for r in rules if r.check_source is not None]
    for path in source_files:
        findings += lint_source(path, source_rules, Options(allowlist=config.allowlist), problems)
    findings = _configure(findings, config)
    report = LintReport(findings, problems, None, rules, len(request_files) + len(source_files), all_findings=findings)
    if baseline is not None:
        report.findings = filter_baseline(findings, load_baseline(baseline))
        report.baselined = len(findings) - len(report.findings)
    if run.prompts is not None:
        found_codes = {f.code for f in findings}
        fixes: dict[str, Fix] = {r.code: r.fix for r in rules if r.fix is not None and r.code in found_codes}
        report.estimate = estimate(
            [r.body for r in records],
            fixes,
            tokenizer,
            block_size=config.block_size,
            capacity_blocks=config.cache_blocks,
            base=run.base,
            targets=_targets(rules, fixes, run.codes),
        )
    return report
