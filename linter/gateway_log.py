"""Reading the gateway's SQLite log (``request_log``, one row per proxied request).

The gateway stores no request bodies, only counters, so from the log the linter
reports what the engines actually achieved: per tenant, the requests, prompt
tokens, cached tokens and hit rate (over the rows whose upstream reported cached
tokens; a NULL ``cached_tokens`` is unknown, not zero), and the warning codes the
gateway attached (its per-request and cross-request linter findings). Read with
SQLAlchemy Core and plain SQL against the documented columns, so the linter does
not import the gateway.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_QUERY = "SELECT tenant, prompt_tokens, cached_tokens, warning_codes FROM request_log"


@dataclass
class TenantStats:
    tenant: str
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    known_prompt_tokens: int = 0  # prompt tokens of rows with a known cached_tokens
    warning_codes: Counter[str] = field(default_factory=Counter)

    @property
    def hit_rate(self) -> float | None:
        return self.cached_tokens / self.known_prompt_tokens if self.known_prompt_tokens else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "tenant": self.tenant,
            "requests": self.requests,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "hit_rate": None if self.hit_rate is None else round(self.hit_rate, 6),
            "warning_codes": dict(sorted(self.warning_codes.items())),
        }


def read_gateway_log(path: Path) -> list[TenantStats]:
    """Per-tenant stats from the gateway's SQLite file; ValueError when it is not one."""
    if not path.is_file():
        raise ValueError(f"gateway database {str(path)!r} does not exist")
    from sqlalchemy import create_engine, text
    from sqlalchemy.exc import SQLAlchemyError

    engine = create_engine(f"sqlite:///{path.resolve()}")
    stats: dict[str, TenantStats] = {}
    try:
        with engine.connect() as connection:
            for tenant, prompt, cached, codes in connection.execute(text(_QUERY)):
                name = tenant if tenant is not None else "(unauthenticated)"
                row = stats.setdefault(name, TenantStats(name))
                row.requests += 1
                row.prompt_tokens += prompt or 0
                if cached is not None and prompt is not None:
                    row.cached_tokens += cached
                    row.known_prompt_tokens += prompt
                row.warning_codes.update(c for c in (codes or "").split(",") if c)
    except SQLAlchemyError as exc:
        raise ValueError(f"{str(path)!r} is not a prefixgate gateway log: {exc.__class__.__name__}: {exc.orig if hasattr(exc, 'orig') else exc}") from None
    finally:
        engine.dispose()
    return sorted(stats.values(), key=lambda s: s.tenant)


def render_text(stats: list[TenantStats]) -> str:
    lines = ["", "Gateway log (per tenant):", f"  {'tenant':<24} {'requests':>8} {'prompt tokens':>13} {'hit rate':>8}  warnings"]
    for s in stats:
        rate = "n/a" if s.hit_rate is None else f"{100 * s.hit_rate:.1f}%"
        codes = ", ".join(f"{c}x{n}" for c, n in sorted(s.warning_codes.items())) or "-"
        lines.append(f"  {s.tenant:<24} {s.requests:>8} {s.prompt_tokens:>13} {rate:>8}  {codes}")
    return "\n".join(lines) + "\n"
