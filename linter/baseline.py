"""The baseline: findings a team accepted, recorded so that only new ones are reported.

A baseline file is JSON ``{"version": 1, "findings": [{"fingerprint", "code",
"path", "location", "message"}, ...]}``. A finding's fingerprint hashes its code,
path, location and message but not its line, so accepted findings stay accepted
when unrelated lines move. Matching is by count: a baseline with two copies of a
fingerprint accepts two findings with it.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from linter.finding import Finding

VERSION = 1


def fingerprint(finding: Finding) -> str:
    key = "\x00".join((finding.code, finding.path, finding.location, finding.message))
    return hashlib.sha256(key.encode("utf-8")).hexdigest()[:32]


def load_baseline(path: Path) -> Counter[str]:
    """Fingerprint counts in a baseline file; ValueError for a missing or malformed file."""
    if not path.is_file():
        raise ValueError(f"baseline {str(path)!r} does not exist; create it with --update-baseline")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ValueError(f"cannot read baseline {str(path)!r}: {exc}") from None
    except ValueError as exc:
        raise ValueError(f"baseline {str(path)!r} is not JSON: {exc}") from None
    entries = data.get("findings") if isinstance(data, dict) else None
    if not isinstance(data, dict) or data.get("version") != VERSION or not isinstance(entries, list):
        raise ValueError(f"baseline {str(path)!r} is not a version {VERSION} prefixgate baseline")
    return Counter(str(e.get("fingerprint")) for e in entries if isinstance(e, dict))


def filter_baseline(findings: Sequence[Finding], accepted: Counter[str]) -> list[Finding]:
    """Findings not accepted by the baseline."""
    remaining = Counter(accepted)
    kept: list[Finding] = []
    for finding in findings:
        fp = fingerprint(finding)
        if remaining[fp] > 0:
            remaining[fp] -= 1
        else:
            kept.append(finding)
    return kept


def write_baseline(path: Path, findings: Sequence[Finding]) -> None:
    entries = [
        {"fingerprint": fingerprint(f), "code": f.code, "path": f.path, "location": f.location, "message": f.message}
        for f in sorted(findings, key=Finding.sort_key)
    ]
    path.write_text(json.dumps({"version": VERSION, "findings": entries}, indent=2) + "\n", encoding="utf-8")
