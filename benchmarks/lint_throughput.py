"""Benchmark: lint a synthetic log of 100k chat-completion requests (target: under 60 s).

Generates a deterministic JSONL corpus (families of applications with shared
instructions and tools, multi-turn conversations, and a share of planted
breaks: timestamps in instructions, shuffled tools, truncated histories), then
runs the whole ``prefixgate lint`` pipeline (per-request rules, cross-request
rules, hit-rate replay with per-rule fixes) and, separately, the per-request API
the gateway calls. Prints a table and writes JSON to benchmarks/results/.

``--compare TREE`` also lints the same corpus with the linter of another
checkout (e.g. main, extracted with ``git archive main | tar -x -C /tmp/main``),
each measurement in a fresh subprocess, alternating the two trees ``--rounds``
times so both see the same machine load; it reports the best and the median
wall time of each and their ratio. Half the corpus's conversations carry no
``metadata.conversation_id`` (``--without-ids`` share), so conversations are
also found by their messages.

    .venv/bin/python benchmarks/lint_throughput.py [--requests 100000]
    .venv/bin/python benchmarks/lint_throughput.py --compare /tmp/main --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from linter.api import check_request  # noqa: E402
from linter.config import LintConfig  # noqa: E402
from linter.runner import lint_paths  # noqa: E402
from linter.tokenizer import ApproxTokenizer  # noqa: E402

WORDS = ["cloud", "bucket", "invoice", "region", "latency", "token", "quota", "replica", "backup", "policy", "network", "storage", "billing", "cluster"]


def _tool(name: str) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": f"Call {name} with a query and return JSON.",
            "parameters": {"properties": {"query": {"type": "string"}}, "required": ["query"], "type": "object"},
        },
    }


def _families(rng: random.Random, count: int) -> list[dict[str, Any]]:
    families = []
    for i in range(count):
        instructions = f"You are assistant #{i} of ACME. " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(60, 160)))
        tools = [_tool(f"tool_{i}_{j}") for j in range(rng.randint(0, 5))]
        families.append({"instructions": instructions, "tools": tools, "volatile": i % 10 == 0, "shuffle": i % 10 == 1})
    return families


def generate(n: int, seed: int = 7, without_ids: float = 0.0) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    families = _families(rng, 50)
    bodies: list[dict[str, Any]] = []
    conversation = 0
    while len(bodies) < n:
        family = rng.choice(families)
        conversation += 1
        history: list[dict[str, Any]] = []
        for turn in range(rng.randint(1, 8)):
            history.append({"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 40)))})
            system = family["instructions"]
            if family["volatile"]:
                system = f"Now: 2026-11-21T{turn:02d}:{rng.randint(0, 59):02d}:00Z. " + system
            tools = list(family["tools"])
            if family["shuffle"]:
                rng.shuffle(tools)
            # A planted sliding window (PS204) in every 7th conversation.
            kept = history[-6:] if conversation % 7 == 0 else history  # prefixgate: noqa: PS305
            body: dict[str, Any] = {"model": "m", "messages": [{"role": "system", "content": system}, *kept]}
            if (conversation * 7919 % 1000) / 1000 >= without_ids:
                body["metadata"] = {"conversation_id": f"c{conversation}"}
            if tools:
                body["tools"] = tools
            bodies.append(body)
            history.append({"role": "assistant", "content": " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 30)))})
            if len(bodies) >= n:
                break
    return bodies


_MEASURE = """
import gc, json, sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from linter.config import LintConfig
from linter.registry import all_rules
from linter.runner import lint_paths
from linter.tokenizer import ApproxTokenizer
import linter
assert linter.__file__.startswith(sys.argv[1]), linter.__file__
config = LintConfig(select=set(all_rules())) if sys.argv[3] == "all" else LintConfig()
t, c = time.perf_counter(), time.process_time()
report = lint_paths([Path(sys.argv[2])], config, ApproxTokenizer())
print(json.dumps({"wall": time.perf_counter() - t, "cpu": time.process_time() - c, "findings": len(report.findings)}))
"""


def _measure(tree: Path, corpus: Path, rules: str) -> dict[str, float]:
    out = subprocess.run([sys.executable, "-c", _MEASURE, str(tree), str(corpus), rules], check=True, capture_output=True, text=True)
    result: dict[str, float] = json.loads(out.stdout)
    return result


def compare(baseline: Path, corpus: Path, rounds: int) -> list[dict[str, Any]]:
    """Wall/CPU time of this tree and ``baseline`` on ``corpus``, alternating (see the module docstring)."""
    runs: dict[str, list[dict[str, float]]] = {"baseline (default rules)": [], "this tree (default rules)": [], "this tree (all rules)": []}
    for _ in range(rounds):
        runs["baseline (default rules)"].append(_measure(baseline, corpus, "default"))
        runs["this tree (default rules)"].append(_measure(ROOT, corpus, "default"))
        runs["this tree (all rules)"].append(_measure(ROOT, corpus, "all"))
    rows = []
    for name, results in runs.items():
        walls = [r["wall"] for r in results]
        rows.append({"tree": name, "best_s": round(min(walls), 2), "median_s": round(statistics.median(walls), 2),
                     "cpu_best_s": round(min(r["cpu"] for r in results), 2), "findings": int(results[0]["findings"])})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=100_000)
    parser.add_argument("--target-s", type=float, default=60.0)
    parser.add_argument("--without-ids", type=float, default=0.5, help="share of conversations without metadata.conversation_id")
    parser.add_argument("--compare", type=Path, metavar="TREE", help="another checkout whose linter to time on the same corpus")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    t0 = time.perf_counter()
    bodies = generate(args.requests, without_ids=args.without_ids)
    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "requests.jsonl"
        corpus.write_text("".join(json.dumps(b) + "\n" for b in bodies), encoding="utf-8")
        size_mb = corpus.stat().st_size / 1e6
        generate_s = time.perf_counter() - t0

        t1, c1 = time.perf_counter(), time.process_time()
        report = lint_paths([corpus], LintConfig(), ApproxTokenizer())
        lint_s, lint_cpu_s = time.perf_counter() - t1, time.process_time() - c1
        comparison = compare(args.compare.resolve(), corpus, args.rounds) if args.compare else None

    sample = bodies[: min(len(bodies), 20_000)]
    t2 = time.perf_counter()
    for body in sample:
        check_request(body)
    per_request_us = (time.perf_counter() - t2) / len(sample) * 1e6

    est = report.estimate
    assert est is not None
    rows = [
        ("requests", f"{len(bodies)}"),
        ("corpus size", f"{size_mb:.1f} MB"),
        ("prompt tokens (approx.)", f"{est.prompt_tokens}"),
        ("findings", f"{len(report.findings)}"),
        ("hit rate now / after fixes", f"{100 * est.hit_rate:.1f}% / {100 * est.hit_rate_after_fixes:.1f}%"),
        ("full lint wall time", f"{lint_s:.1f} s (target < {args.target_s:.0f} s)"),
        ("full lint CPU time", f"{lint_cpu_s:.1f} s (load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs)"),
        ("lint throughput", f"{len(bodies) / lint_s:,.0f} requests/s"),
        ("check_request (gateway path)", f"{per_request_us:.0f} us/request"),
        ("corpus generation (not counted)", f"{generate_s:.1f} s"),
    ]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    if comparison is not None:
        print(f"\nsame corpus, fresh process per run, {args.rounds} alternating rounds (baseline: {args.compare}):")
        print(f"  {'tree':<28} {'best':>7} {'median':>7} {'CPU best':>9} {'findings':>9} {'wall ratio':>11} {'CPU ratio':>10}")
        base, base_cpu = comparison[0]["best_s"], comparison[0]["cpu_best_s"]
        for row in comparison:
            print(
                f"  {row['tree']:<28} {row['best_s']:>6.2f}s {row['median_s']:>6.2f}s {row['cpu_best_s']:>8.2f}s {row['findings']:>9} "
                f"{row['best_s'] / base:>10.2f}x {row['cpu_best_s'] / base_cpu:>9.2f}x"
            )
    results = {
        "benchmark": "lint_throughput",
        "requests": len(bodies),
        "corpus_mb": round(size_mb, 2),
        "prompt_tokens": est.prompt_tokens,
        "findings": len(report.findings),
        "findings_by_code": {c: sum(1 for f in report.findings if f.code == c) for c in sorted({f.code for f in report.findings})},
        "hit_rate": est.hit_rate,
        "hit_rate_after_fixes": est.hit_rate_after_fixes,
        "lint_seconds": round(lint_s, 2),
        "lint_cpu_seconds": round(lint_cpu_s, 2),
        "load_average_1m": round(os.getloadavg()[0], 2),
        "requests_per_second": round(len(bodies) / lint_s),
        "check_request_us": round(per_request_us, 1),
        "target_seconds": args.target_s,
        "met_target": lint_s < args.target_s,
        "without_ids": args.without_ids,
        "comparison": comparison,
        "python": platform.python_version(),
        "machine": platform.machine(),
    }
    out_dir = ROOT / "benchmarks" / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "lint_throughput.json").write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {out_dir / 'lint_throughput.json'}")
    return 0 if lint_s < args.target_s else 1


if __name__ == "__main__":
    sys.exit(main())
