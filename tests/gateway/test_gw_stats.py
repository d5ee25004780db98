"""Stats rows (exactly one per request under a mixed concurrent load), the writer,
migrations up/down/up, and the hit-rate report."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from datetime import datetime

import httpx
import orjson
from gw_fakes import gateway_client, make_settings, rows
from sqlalchemy import inspect

from gateway.policy.api_key import hash_key
from gateway.request_record import RequestRecord
from gateway.stats import database
from gateway.stats.report import per_tenant_model_hour
from gateway.stats.writer import StatsWriter

HEAD = "2026_11_24_stored_responses"

CONFIG = {"tenants": {"alpha": {"keys": [hash_key("a")]}, "beta": {"keys": [hash_key("b")]}}}


def test_exactly_one_row_per_request_after_a_mixed_load(tmp_path, fake_upstream):
    chat = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}
    plan = (
        [("a", chat, 200)] * 20
        + [("b", {**chat, "stream": True}, 200)] * 15
        + [("b", {**chat, "model": "missing-model"}, 404)] * 5
        + [("nope", chat, 401)] * 7
        + [("a", {"model": "fake-model", "messages": "x"}, 400)] * 6
        + [("a", {"model": "fake-model", "prompt": "x"}, 200)] * 4
    )

    async def go():
        settings = make_settings(tmp_path, CONFIG)
        async with gateway_client(settings, httpx.ASGITransport(fake_upstream.app)) as gw:
            async def one(key, body, expected):
                path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
                response = await gw.post(path, json=body, headers={"authorization": f"Bearer {key}"})
                assert response.status_code == expected, response.text
            await asyncio.gather(*(one(*item) for item in plan))
        return settings  # leaving the context closed the app: the writer drained

    settings = asyncio.run(go())
    logged = rows(settings.db_url)
    assert len(logged) == len(plan)
    count = {}
    for row in logged:
        count[(row.tenant, row.status)] = count.get((row.tenant, row.status), 0) + 1
    assert count == {("alpha", 200): 24, ("beta", 200): 15, ("beta", 404): 5, (None, 401): 7, ("alpha", 400): 6}
    streamed = [r for r in logged if r.stream]
    assert len(streamed) == 15 and all(r.prompt_tokens and r.cached_tokens == 16 for r in streamed)
    assert all(r.latency_ms >= (r.ttft_ms or 0) for r in logged)


def test_writer_batches_and_drains_on_close(tmp_path):
    url = database.default_db_url(tmp_path)
    database.upgrade(url)
    engine = database.create_db_engine(url)
    writer = StatsWriter(engine, batch_size=7)
    for i in range(100):
        record = RequestRecord("chat.completions", "http://u", tenant=f"t{i % 3}", model="m")
        record.finish(200)
        writer.submit(record)
    assert writer.flush(30)
    assert writer.written == 100
    for _ in range(50):
        writer.submit(RequestRecord("completions", "http://u"))
    writer.close()
    writer.close()  # idempotent
    assert writer.written == 150 and writer.dropped == 0
    assert len(rows(url)) == 150
    with engine.connect() as connection:
        assert connection.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
    engine.dispose()


def test_migrations_upgrade_downgrade_upgrade(tmp_path):
    url = database.default_db_url(tmp_path)
    database.upgrade(url)
    assert database.current_revision(url) == HEAD
    engine = database.create_db_engine(url)
    columns = {c["name"] for c in inspect(engine).get_columns("request_log")}
    assert {"time", "tenant", "model", "upstream", "status", "prompt_tokens", "cached_tokens",
            "completion_tokens", "ttft_ms", "latency_ms", "warning_codes", "canonicalization"} <= columns
    engine.dispose()
    database.downgrade(url, "base")
    assert database.current_revision(url) is None
    engine = database.create_db_engine(url)
    assert not {"request_log", "stored_response"} & set(inspect(engine).get_table_names())
    engine.dispose()
    database.upgrade(url)
    assert database.current_revision(url) == HEAD


def test_cli_db_and_stats(tmp_path):
    url = database.default_db_url(tmp_path)
    cli = [sys.executable, "-m", "gateway.cli"]
    done = subprocess.run([*cli, "db", "upgrade", "--data-dir", str(tmp_path)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and HEAD in done.stdout, done.stderr
    engine = database.create_db_engine(url)
    writer = StatsWriter(engine)
    for tenant, prompt, cached in [("alpha", 100, 64), ("alpha", 100, 96), ("beta", 50, None)]:
        record = RequestRecord("chat.completions", "http://u", tenant=tenant, model="m",
                               time=datetime(2026, 11, 22, 1, 30), prompt_tokens=prompt, cached_tokens=cached)
        record.finish(200)
        writer.submit(record)
    writer.close()
    groups = per_tenant_model_hour(engine)
    engine.dispose()
    assert groups[("alpha", "m", "2026-11-22 01:00")].hit_rate == 0.8
    assert groups[("beta", "m", "2026-11-22 01:00")].hit_rate is None
    text = subprocess.run([*cli, "stats", "--data-dir", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert text.returncode == 0
    assert "80.0%" in text.stdout and "unknown" in text.stdout
    as_json = subprocess.run([*cli, "stats", "--db-url", url, "--format", "json"], capture_output=True, timeout=120)
    data = orjson.loads(as_json.stdout)
    assert {(d["tenant"], d["hit_rate"]) for d in data} == {("alpha", 0.8), ("beta", None)}
    down = subprocess.run([*cli, "db", "downgrade", "base", "--db-url", url], capture_output=True, text=True,
                          timeout=120)
    assert down.returncode == 0 and "base" in down.stdout


def test_table_definition_matches_the_migrations(tmp_path):
    from alembic.autogenerate import compare_metadata
    from alembic.runtime.migration import MigrationContext

    import gateway.responses.store  # noqa: F401  (its table joins the metadata)
    from gateway.stats.table import metadata

    url = database.default_db_url(tmp_path)
    database.upgrade(url)
    engine = database.create_db_engine(url)
    with engine.connect() as connection:
        assert compare_metadata(MigrationContext.configure(connection), metadata) == []
    engine.dispose()
