"""What ``prefixgate lint`` does with its parsed arguments (the CLI's one error boundary is in :mod:`linter.cli`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from linter.baseline import write_baseline
from linter.config import LintConfig, check_fail_on, load_config
from linter.finding import severity_rank
from linter.formats import FORMATS
from linter.registry import all_rules, expand_codes, get_rule
from linter.runner import LintReport, lint_paths
from linter.tokenizer import load_tokenizer


def _codes(value: str | None) -> list[str]:
    return [c for c in (value or "").split(",") if c.strip()]


def _config(args: argparse.Namespace) -> LintConfig:
    config = load_config(Path(args.config) if args.config else None, Path.cwd())
    if args.select:
        config.select = expand_codes(_codes(args.select))
    if args.extend_select:
        config.select |= expand_codes(_codes(args.extend_select))
    if args.ignore:
        config.ignore |= expand_codes(_codes(args.ignore))
    if args.fail_on:
        config.fail_on = check_fail_on(args.fail_on)
    for name, attr in (("block_size", "block_size"), ("cache_blocks", "cache_blocks")):
        value = getattr(args, name)
        if value is not None:
            if value <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, got {value}")
            setattr(config, attr, value)
    if args.tokenizer:
        config.tokenizer = args.tokenizer
    if args.baseline:
        config.baseline = args.baseline
    return config


def list_rules() -> str:
    lines = [f"{'code':<6}  {'severity':<8}  {'scope':<7}  {'name':<30}  summary"]
    for rule in all_rules().values():
        lines.append(f"{rule.code:<6}  {rule.severity:<8}  {rule.scope:<7}  {rule.name:<30}  {rule.summary}")
    return "\n".join(lines) + "\n"


def exit_code(report: LintReport, fail_on: str) -> int:
    if fail_on == "never":
        return 0
    threshold = severity_rank(fail_on)
    return 1 if any(severity_rank(f.severity) >= threshold for f in report.findings) else 0


def _color(args: argparse.Namespace) -> bool:
    if args.color == "always":
        return True
    return args.color == "auto" and args.output is None and sys.stdout.isatty()


def execute(args: argparse.Namespace) -> int:
    if args.explain:
        sys.stdout.write(get_rule(args.explain).doc.strip() + "\n")
        return 0
    if args.list_rules:
        sys.stdout.write(list_rules())
        return 0
    if not args.paths and not args.db:
        raise ValueError("no input: give request logs, Python files or directories (or --db)")
    config = _config(args)
    if args.update_baseline and not config.baseline:
        raise ValueError("--update-baseline needs --baseline FILE (or 'baseline' in [tool.prefixgate.lint])")
    tokenizer = load_tokenizer(config.tokenizer)
    baseline = Path(config.baseline) if config.baseline and not args.update_baseline else None
    report = lint_paths(
        [Path(p) for p in args.paths], config, tokenizer, baseline=baseline, with_estimate=not args.no_estimate
    )
    if args.update_baseline:
        assert config.baseline is not None
        write_baseline(Path(config.baseline), report.all_findings)
        print(f"wrote {len(report.all_findings)} finding(s) to {config.baseline}", file=sys.stderr)
        return 0
    if args.db:
        from linter.gateway_log import read_gateway_log

        report.gateway_log = read_gateway_log(Path(args.db))
    text = FORMATS[args.format](report, args.statistics, _color(args))
    if args.output:
        Path(args.output).write_text(text, encoding="utf-8")
    else:
        sys.stdout.write(text)
    return exit_code(report, config.fail_on)
