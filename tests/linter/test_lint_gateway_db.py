"""``prefixgate lint --db``: per-tenant hit rates and warning codes from a real gateway SQLite log."""

import json
from datetime import datetime

from lint_cli_helpers import run_lint
from sqlalchemy import create_engine, insert

from gateway.stats.table import metadata, request_log


def _row(tenant, prompt, cached, codes=""):
    return {
        "time": datetime(2026, 11, 21, 9, 0, 0),
        "tenant": tenant,
        "endpoint": "chat.completions",
        "model": "m",
        "upstream": "http://127.0.0.1:9",
        "status": 200,
        "stream": False,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "completion_tokens": 5,
        "ttft_ms": 1.0,
        "latency_ms": 2.0,
        "warning_codes": codes,
        "canonicalization": "",
        "error_code": None,
    }


def _db(path):
    engine = create_engine(f"sqlite:///{path}")
    metadata.create_all(engine)
    with engine.begin() as connection:
        connection.execute(
            insert(request_log),
            [
                _row("acme", 100, 64, "PS101"),
                _row("acme", 100, 32, "PS101,PS202"),
                _row("acme", 50, None),  # unknown cached tokens: not in the rate
                _row("globex", 200, 0),
                _row(None, None, None),
            ],
        )
    engine.dispose()


def test_db_reports_per_tenant_hit_rate_and_codes(tmp_path, capsys):
    path = tmp_path / "gateway.sqlite"
    _db(path)
    config = tmp_path / "pyproject.toml"
    config.write_text("")
    assert run_lint(["--db", str(path), "--format", "json"], config) == 0
    log = {row["tenant"]: row for row in json.loads(capsys.readouterr().out)["gateway_log"]}
    assert log["acme"]["requests"] == 3
    assert log["acme"]["prompt_tokens"] == 250
    assert log["acme"]["hit_rate"] == 96 / 200
    assert log["acme"]["warning_codes"] == {"PS101": 2, "PS202": 1}
    assert log["globex"]["hit_rate"] == 0
    assert log["(unauthenticated)"]["hit_rate"] is None
    assert run_lint(["--db", str(path)], config) == 0
    out = capsys.readouterr().out
    assert "Gateway log (per tenant)" in out and "48.0%" in out


def test_db_that_is_not_a_gateway_log_exits_2(tmp_path, capsys):
    path = tmp_path / "other.sqlite"
    engine = create_engine(f"sqlite:///{path}")
    with engine.begin() as connection:
        connection.exec_driver_sql("CREATE TABLE t (x INTEGER)")
    engine.dispose()
    config = tmp_path / "pyproject.toml"
    config.write_text("")
    assert run_lint(["--db", str(path)], config) == 2
    assert "not a prefixgate gateway log" in capsys.readouterr().err
    assert run_lint(["--db", str(tmp_path / "missing.sqlite")], config) == 2
