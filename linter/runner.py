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

One finding per cause: a PS201 divergence inside a value that PS101 already
reports on the same record is not reported again. With the estimate, a finding
that its rule's fix applies to (the fix changes its record, or its record hits
more tokens in the rule's fixed replay) gets that measured gain as ``tokens_lost`` (the first finding of the rule on the
record; later ones 0), so those findings add up to the rule's row of the
table; findings the fix does not repair keep the loss measured by the
comparison with the earlier request, and the table says how many there are.
"""

from __future__ import annotations

import gc
import re
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

_RANGE = re.compile(r"^(?P<path>.*)\[(?P<start>\d+)(?::(?P<end>\d+))?\]$")
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
    unrepaired: dict[str, tuple[int, int]] = field(default_factory=dict)  # code -> findings its fix does not repair
    gained_elsewhere: dict[str, int] = field(default_factory=dict)  # code -> gain of its fix on requests without its finding


def collect_paths(paths: Sequence[Path], config: LintConfig | None = None) -> tuple[list[Path], list[Path]]:
    """(request files, Python files); ValueError for a missing path or unsupported file.

    Python files found in a directory are skipped when ``config.excludes`` them
    (test files by default); files named explicitly are always kept.
    """
    requests: list[Path] = []
    sources: list[Path] = []
    for path in paths:
        if path.is_dir():
            for child in sorted(path.rglob("*")):
                if any(part in _SKIP_DIRS or part.startswith(".") for part in child.relative_to(path).parts):
                    continue
                if child.is_file() and child.suffix in REQUEST_SUFFIXES:
                    requests.append(child)
                elif child.is_file() and child.suffix == ".py" and not (config and config.excludes(child.relative_to(path))):
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
        self.record_of: list[int] = []  # the record index of each finding
        self.codes: list[set[str]] = []
        self.base: list[Prompt] = []

    def _emit(self, finding: Finding, codes: set[str]) -> None:
        self.findings.append(finding)
        self.record_of.append(len(self.codes))
        codes.add(finding.code)

    def add(self, record: Record) -> None:
        codes: set[str] = set()
        rendered = render(record.body)
        first = len(self.findings)
        for rule in self.request_rules:
            assert rule.check_request is not None
            for hit in rule.check_request(record.body, self.options):
                line, column = record.locate(hit.needle)
                lost = static_tokens_lost(rendered, hit.location, self.tokenizer, self.block_size)
                self._emit(Finding(rule.code, rule.severity, hit.message, record.path, line, column, hit.location, lost), codes)
        if self.families is not None:
            found = self.families.add(record.body, rendered)
            if found is not None and found.code in self.enabled and not _reported(found.code, found.location, self.findings[first:]):
                rule = all_rules()[found.code]
                line, column = record.locate(found.needle)
                self._emit(Finding(rule.code, rule.severity, found.message, record.path, line, column, found.location, found.tokens_lost), codes)
        self.codes.append(codes)
        if self.prompts is not None:
            self.base.append(self.prompts.of_rendered(rendered))


def _reported(code: str, location: str, same_record: Sequence[Finding]) -> bool:
    """Whether a PS201 divergence at ``location`` lies inside a value a PS101 finding of the record reports."""
    point = _RANGE.match(location)
    if code != "PS201" or point is None:
        return False
    for finding in same_record:
        span = _RANGE.match(finding.location) if finding.code == "PS101" else None
        if (
            span is not None
            and span.group("path") == point.group("path")
            and span.group("end") is not None
            and int(span.group("start")) <= int(point.group("start")) < int(span.group("end"))
        ):
            return True
    return False


def _measured(findings: list[tuple[Finding, int]], estimate: Estimate) -> tuple[list[tuple[Finding, int]], dict[str, tuple[int, int]]]:
    """Findings their rule's fix applies to carry the gain measured on their record (module docstring).

    Also returns, per code, the findings the fix does not repair: (count, tokens lost).
    """
    gains = {gain.code: gain for gain in estimate.per_rule}
    given: set[tuple[str, int]] = set()
    out: list[tuple[Finding, int]] = []
    unrepaired: dict[str, tuple[int, int]] = {}
    for finding, index in findings:
        rule_gain = gains.get(finding.code)
        if index >= 0 and rule_gain is not None:
            gain = max(0, rule_gain.deltas.get(index, 0))
            if gain > 0 or index in rule_gain.changed:
                finding = replace(finding, tokens_lost=0 if (finding.code, index) in given else gain)
                given.add((finding.code, index))
            else:
                count, lost = unrepaired.get(finding.code, (0, 0))
                unrepaired[finding.code] = (count + 1, lost + (finding.tokens_lost or 0))
        out.append((finding, index))
    return out, unrepaired


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


def _configure(findings: list[tuple[Finding, int]], config: LintConfig) -> list[tuple[Finding, int]]:
    """Per-file ignores and severity overrides; (finding, record index or -1 for sources) pairs kept in order."""
    out: list[tuple[Finding, int]] = []
    for finding, index in findings:
        if finding.code in config.ignored_for(finding.path):
            continue
        severity = config.severity_of(finding.code, finding.severity)
        out.append((finding if severity == finding.severity else replace(finding, severity=severity), index))
    return out


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
    request_files, source_files = collect_paths(paths, config)
    enabled = config.enabled()
    rules = [r for code, r in all_rules().items() if code in enabled]
    problems: list[LoadProblem] = []
    records = [record for path in request_files for record in load_file(path, problems)]
    run = _RecordPass(rules, config, tokenizer, with_estimate and bool(records))
    for record in records:
        run.add(record)
    pairs = list(zip(run.findings, run.record_of, strict=True))
    source_rules = [r for r in rules if r.check_source is not None]
    for path in source_files:
        pairs += [(f, -1) for f in lint_source(path, source_rules, Options(allowlist=config.allowlist), problems)]
    pairs = _configure(pairs, config)
    result: Estimate | None = None
    if run.prompts is not None:
        found_codes = {f.code for f, _ in pairs}
        fixes: dict[str, Fix] = {r.code: r.fix for r in rules if r.fix is not None and r.code in found_codes}
        codes: list[set[str]] = [set() for _ in records]
        for finding, index in pairs:
            if index >= 0:
                codes[index].add(finding.code)
        result = estimate(
            [r.body for r in records],
            fixes,
            tokenizer,
            block_size=config.block_size,
            capacity_blocks=config.cache_blocks,
            base=run.base,
            targets=_targets(rules, fixes, codes),
        )
        pairs, unrepaired = _measured(pairs, result)
    findings = sorted((f for f, _ in pairs), key=Finding.sort_key)
    report = LintReport(findings, problems, result, rules, len(request_files) + len(source_files), all_findings=findings)
    if result is not None:
        report.unrepaired = unrepaired
        with_finding = {(f.code, i) for f, i in pairs}
        report.gained_elsewhere = {
            g.code: sum(d for i, d in g.deltas.items() if (g.code, i) not in with_finding) for g in result.per_rule
        }
    if baseline is not None:
        report.findings = filter_baseline(findings, load_baseline(baseline))
        report.baselined = len(findings) - len(report.findings)
    return report
