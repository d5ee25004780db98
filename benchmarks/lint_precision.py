"""Benchmark: precision and recall of every default rule on the labelled corpora.

The corpora are in examples/corpora/: request logs (``logs/*.jsonl``, each line
labelled with the codes it must get in ``expect``; regenerate with
``examples/corpora/generate_logs.py``) and prompt-building Python code in
several styles (``code/``, each cause marked ``# expect: PSNNN``; its ``tests/``
folder is excluded by default like every test file). Each log file is linted
on its own (as a user would lint one service's log), the code folder in one run,
with the default configuration. A finding is a true positive when its
(file, line, code) is labelled. Targets: precision >= 0.95 and recall >= 0.9
for every default rule, and zero findings on the files labelled clean.

    .venv/bin/python benchmarks/lint_precision.py

Prints a table, writes benchmarks/results/lint_precision.json and exits 1 when a
target is missed.
"""

from __future__ import annotations

import json
import re
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from linter.config import LintConfig  # noqa: E402
from linter.registry import all_rules, default_codes  # noqa: E402
from linter.runner import lint_paths  # noqa: E402
from linter.tokenizer import ApproxTokenizer  # noqa: E402

CORPORA = ROOT / "examples" / "corpora"
PRECISION_TARGET, RECALL_TARGET = 0.95, 0.9
_MARKER = re.compile(r"#\s*expect:\s*(PS\d{3}(?:\s*,\s*PS\d{3})*)")

Label = tuple[str, int, str]  # (path relative to the corpora, line, code)


def _relative(path: str | Path) -> str:
    return Path(path).resolve().relative_to(CORPORA).as_posix()


def expected_logs(path: Path) -> Counter[Label]:
    labels: Counter[Label] = Counter()
    for line_number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        for code in json.loads(line).get("expect", []):
            labels[(_relative(path), line_number, code)] += 1
    return labels


def expected_code(folder: Path, config: LintConfig) -> Counter[Label]:
    labels: Counter[Label] = Counter()
    for path in sorted(folder.rglob("*.py")):
        if config.excludes(path.relative_to(folder)):
            continue
        for line_number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            marker = _MARKER.search(line)
            if marker is not None:
                for code in marker.group(1).split(","):
                    labels[(_relative(path), line_number, code.strip())] += 1
    return labels


def evaluate() -> dict[str, object]:
    """Runs the linter on every corpus; returns per-rule counts, per-file totals and the clean files' findings."""
    config = LintConfig()
    tokenizer = ApproxTokenizer()
    expected: Counter[Label] = Counter()
    found: Counter[Label] = Counter()
    per_file: dict[str, dict[str, int]] = {}
    runs = [([path], expected_logs(path), [path]) for path in sorted((CORPORA / "logs").glob("*.jsonl"))]
    code = CORPORA / "code"
    sources = [p for p in sorted(code.rglob("*.py")) if not config.excludes(p.relative_to(code))]
    runs.append(([code], expected_code(code, config), sources))
    for paths, labels, files in runs:
        report = lint_paths(paths, config, tokenizer)
        got: Counter[Label] = Counter((_relative(f.path), f.line or 0, f.code) for f in report.findings)
        expected += labels
        found += got
        for path in {label[0] for label in labels} | {label[0] for label in got} | {_relative(p) for p in files}:
            per_file[path] = {
                "expected": sum(n for label, n in labels.items() if label[0] == path),
                "found": sum(n for label, n in got.items() if label[0] == path),
            }
    rules: dict[str, dict[str, float | int | bool | None]] = {}
    for code in sorted(default_codes()):
        exp = Counter({k: n for k, n in expected.items() if k[2] == code})
        got = Counter({k: n for k, n in found.items() if k[2] == code})
        tp = sum((exp & got).values())
        fp, fn = sum(got.values()) - tp, sum(exp.values()) - tp
        precision = tp / (tp + fp) if tp + fp else None
        recall = tp / (tp + fn) if tp + fn else None
        met = precision is not None and recall is not None and precision >= PRECISION_TARGET and recall >= RECALL_TARGET
        rules[code] = {"expected": sum(exp.values()), "found": sum(got.values()), "tp": tp, "fp": fp, "fn": fn,
                       "precision": precision, "recall": recall, "met": met}
    clean = {path: counts["found"] for path, counts in per_file.items() if counts["expected"] == 0}
    mistakes = sorted([("false positive", *k) for k in (found - expected)] + [("missed", *k) for k in (expected - found)])
    return {"rules": rules, "files": per_file, "clean_findings": clean, "mistakes": mistakes}


def _fmt(value: object) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def main() -> int:
    result = evaluate()
    rules = result["rules"]
    assert isinstance(rules, dict)
    print(f"{'rule':<6} {'name':<30} {'labelled':>8} {'found':>6} {'TP':>4} {'FP':>4} {'FN':>4} {'precision':>9} {'recall':>7}  target")
    for code, row in rules.items():
        print(
            f"{code:<6} {all_rules()[code].name:<30} {row['expected']:>8} {row['found']:>6} {row['tp']:>4} {row['fp']:>4} {row['fn']:>4} "
            f"{_fmt(row['precision']):>9} {_fmt(row['recall']):>7}  {'met' if row['met'] else 'MISSED'}"
        )
    clean = result["clean_findings"]
    assert isinstance(clean, dict)
    print(f"files labelled clean: {len(clean)}, findings on them: {sum(clean.values())} ({', '.join(sorted(clean))})")
    for mistake in result["mistakes"]:  # type: ignore[attr-defined]
        print("  " + " ".join(map(str, mistake)))
    out_dir = ROOT / "benchmarks" / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "lint_precision.json").write_text(json.dumps({"benchmark": "lint_precision", **result}, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {out_dir / 'lint_precision.json'}")
    ok = all(row["met"] for row in rules.values()) and sum(clean.values()) == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
