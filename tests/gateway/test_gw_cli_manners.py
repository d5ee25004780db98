"""CLI manners, one test per user mistake: one line on stderr, exit 2, no traceback;
a closed pipe ends a command quietly; ``stats`` never creates a database."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
from collections.abc import Iterator
from datetime import datetime, timedelta

from sqlalchemy import insert
from support.net import free_port

from gateway.stats import database
from gateway.stats.table import request_log

CLI = [sys.executable, "-m", "gateway.cli"]


def prefixgate(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout)


def assert_usage_error(done: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    assert "Traceback" not in done.stderr + done.stdout
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


@contextlib.contextmanager
def listening() -> Iterator[int]:
    """A port held by a listening socket (another server) for the duration."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield int(sock.getsockname()[1])


def test_missing_config_file_is_one_line(tmp_path):
    missing = tmp_path / "missing.toml"
    done = prefixgate("gateway", "--upstream", "http://127.0.0.1:1", "--config", str(missing),
                      "--data-dir", str(tmp_path), "--port", str(free_port()))
    assert_usage_error(done, "missing.toml", "No such file")


def test_bad_option_value_is_one_line():
    assert_usage_error(prefixgate("gateway", "--port", "eighty"), "--port", "invalid int value")


def test_gateway_port_in_use_is_one_line(tmp_path):
    with listening() as port:
        done = prefixgate("gateway", "--upstream", "http://127.0.0.1:1", "--data-dir", str(tmp_path),
                          "--port", str(port))
    assert_usage_error(done, f"port {port}", "already in use")
    assert not (tmp_path / "secret").exists()  # nothing was started or created


def test_serve_checks_the_engine_port_before_starting_anything(tmp_path):
    with listening() as engine_port:
        done = prefixgate("serve", "--data-dir", str(tmp_path), "--port", str(free_port()),
                          "--engine-port", str(engine_port))
    assert_usage_error(done, "engine port", "already in use")
    assert "starting the engine" not in done.stdout + done.stderr


def test_serve_checks_the_gateway_port_before_starting_the_engine(tmp_path):
    with listening() as port:
        done = prefixgate("serve", "--data-dir", str(tmp_path), "--port", str(port),
                          "--engine-port", str(free_port()))
    assert_usage_error(done, "gateway port", "already in use")
    assert "starting the engine" not in done.stdout + done.stderr


def test_serve_refuses_one_port_for_both(tmp_path):
    port = str(free_port())
    done = prefixgate("serve", "--data-dir", str(tmp_path), "--port", port, "--engine-port", port)
    assert_usage_error(done, "different ports")


def test_openai_upstream_without_an_api_key_is_one_line(tmp_path):
    done = subprocess.run(
        [*CLI, "gateway", "--upstream", "https://api.openai.com/v1", "--data-dir", str(tmp_path),
         "--port", str(free_port())],
        capture_output=True, text=True, timeout=120,
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
    )
    assert_usage_error(done, "OPENAI_API_KEY")


def test_keys_create_with_a_broken_config_still_prints_the_hash_line(tmp_path):
    config = tmp_path / "gateway.toml"
    config.write_text("[tenants.acme\nkeys = [\n")  # not TOML
    done = prefixgate("keys", "create", "acme", "--config", str(config))
    assert_usage_error(done, "gateway.toml", "add it by hand")
    assert "store it now" in done.stdout
    assert "[tenants.acme]" in done.stdout and 'keys = ["sha256:' in done.stdout
    assert config.read_text() == "[tenants.acme\nkeys = [\n"  # untouched


def test_stats_with_a_wrong_data_dir_creates_nothing(tmp_path):
    typo = tmp_path / "typo"
    done = prefixgate("stats", "--data-dir", str(typo))
    assert_usage_error(done, "no stats database", str(typo))
    assert not typo.exists()


def test_db_current_and_downgrade_never_create_a_database(tmp_path):
    typo = tmp_path / "typo"
    assert_usage_error(prefixgate("db", "current", "--data-dir", str(typo)), "no stats database")
    assert_usage_error(prefixgate("db", "downgrade", "base", "--data-dir", str(typo)), "no stats database")
    assert not typo.exists()


def test_db_with_an_unknown_revision_is_one_line(tmp_path):
    done = prefixgate("db", "upgrade", "no-such-revision", "--data-dir", str(tmp_path))
    assert_usage_error(done, "prefixgate db upgrade", "no-such-revision")
    assert_usage_error(prefixgate("db", "downgrade", "--data-dir", str(tmp_path / "x")), "give a revision")


def test_stats_on_a_file_that_is_not_a_stats_database(tmp_path):
    other = tmp_path / "other.db"
    import sqlite3

    with contextlib.closing(sqlite3.connect(other)) as connection:
        connection.execute("CREATE TABLE t (x)")
    before = other.read_bytes()
    done = prefixgate("stats", "--db-url", f"sqlite:///{other}")
    assert_usage_error(done, "not a prefixgate stats database")
    assert other.read_bytes() == before


def test_stats_into_a_closed_pipe_exits_quietly(tmp_path):
    url = database.default_db_url(tmp_path)
    database.upgrade(url)
    engine = database.create_db_engine(url)
    start = datetime(2026, 1, 1)
    rows = [
        {"time": start + timedelta(hours=i), "tenant": f"tenant-{i % 7}", "endpoint": "chat.completions",
         "model": "m", "upstream": "http://u", "status": 200, "stream": False, "prompt_tokens": 100,
         "cached_tokens": 50, "completion_tokens": 1, "latency_ms": 1.0}
        for i in range(3000)  # ~3000 report lines, far more than a pipe buffer holds
    ]
    with engine.begin() as connection:
        connection.execute(insert(request_log), rows)
    engine.dispose()
    process = subprocess.Popen([*CLI, "stats", "--data-dir", str(tmp_path)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert process.stdout is not None and process.stderr is not None
    assert process.stdout.readline().startswith("tenant")
    process.stdout.close()  # like `| head -1`
    stderr = process.stderr.read()
    assert process.wait(timeout=120) == 1
    assert stderr == ""
