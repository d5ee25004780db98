"""``GET /dashboard`` over HTTP: access rules, the numbers in its JSON island (from a
real SQLite file) and the page's safety headers. The browser test is
test_gw_dashboard_browser.py."""

from __future__ import annotations

import asyncio
import base64
import re
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import orjson
import pytest
from gw_fakes import gateway_client, make_settings
from sqlalchemy import insert

from gateway.policy.api_key import hash_key
from gateway.stats import database
from gateway.stats.dashboard.summary import parse_hours
from gateway.stats.table import request_log

ADMIN, TENANT = "pg-admin-key", "pg-alpha-key"
CONFIG = {
    "server": {"admin_keys": [hash_key(ADMIN)], "input_price_per_million": 2.0,
               "cached_input_price_per_million": 0.5},
    "tenants": {"alpha": {"keys": [hash_key(TENANT)]}, "beta": {}},
}


def seed(db_url: str, now: datetime | None = None) -> datetime:
    """Rows of two tenants over three hours, one unauthenticated, one outside the window."""
    now = (now or datetime.now(UTC).replace(tzinfo=None)).replace(minute=30, second=0, microsecond=0)
    hour = timedelta(hours=1)

    def row(at: datetime, tenant: str | None, prompt: int | None, cached: int | None, ttft: float | None,
            warnings: str = "", status: int = 200, model: str | None = "smol", stream: bool = True) -> dict[str, Any]:
        return {"time": at, "tenant": tenant, "endpoint": "chat.completions", "model": model, "upstream": "http://u",
                "status": status, "stream": stream, "prompt_tokens": prompt, "cached_tokens": cached,
                "completion_tokens": 5 if prompt else None, "ttft_ms": ttft,
                "latency_ms": 2 * ttft if ttft is not None else 1.0, "warning_codes": warnings}

    rows = [
        row(now - 2 * hour, "alpha", 100, 50, 120.0, "PS101,PS104"),
        row(now - hour, "alpha", 200, 180, 950.5),
        row(now - hour, "beta", 100, 0, 3000.0, "PS101", stream=False),  # its "TTFT" is its latency
        row(now, "beta", 100, None, None),
        row(now, None, None, None, None, status=401, model=None),
        row(now - timedelta(days=8), "alpha", 1000, 1000, 5000.0, "PS999"),  # outside the week
    ]
    database.upgrade(db_url)
    engine = database.create_db_engine(db_url)
    with engine.begin() as connection:
        connection.execute(insert(request_log), rows)
    engine.dispose()
    return now


def island(html: str) -> dict[str, Any]:
    match = re.search(r'<script id="dashboard-data" type="application/json">(.*?)</script>', html, re.S)
    assert match is not None
    return orjson.loads(match.group(1))


def get(settings, *paths_and_headers: tuple[str, dict[str, str]]) -> list[httpx.Response]:
    async def go() -> list[httpx.Response]:
        async with gateway_client(settings, httpx.MockTransport(lambda r: httpx.Response(500))) as gw:
            return [await gw.get(path, headers=headers) for path, headers in paths_and_headers]

    return asyncio.run(go())


def basic(password: str) -> dict[str, str]:
    return {"authorization": "Basic " + base64.b64encode(f"me:{password}".encode()).decode()}


def test_summary_numbers_from_a_real_sqlite_file(tmp_path):
    settings = make_settings(tmp_path, CONFIG)
    seed(settings.db_url)
    (page,) = get(settings, ("/dashboard", {"authorization": f"Bearer {ADMIN}"}))
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    data = island(page.text)
    alpha, beta = data["tenants"]["alpha"], data["tenants"]["beta"]
    assert (alpha["requests"], alpha["prompt_tokens"], alpha["cached_tokens"]) == (2, 300, 230)
    assert alpha["hit_rate"] == pytest.approx(230 / 300)
    assert beta["hit_rate"] == 0.0 and beta["requests_with_unknown_cached_tokens"] == 1
    assert data["tenants"]["(unauthenticated)"]["errors"] == 1
    assert data["totals"]["saved_tokens"] == 230
    assert data["totals"]["saved_cost"] == pytest.approx(230 * 1.5 / 1e6)
    assert [point["hit_rate"] for point in data["series"]["alpha"]] == [0.5, 0.9]
    assert [point["cached_tokens"] for point in data["series"]["beta"]] == [0, 0]
    assert data["warnings"] == [{"code": "PS101", "count": 2}, {"code": "PS104", "count": 1}]
    # Only streamed requests have a time to first token of their own; latency beside it.
    assert [(entry["ttft_ms"], entry["latency_ms"]) for entry in data["slowest"]] == [(950.5, 1901.0), (120.0, 240.0)]
    assert data["slowest"][0]["tenant"] == "alpha"


def test_access_needs_an_admin_key_with_a_config(tmp_path):
    settings = make_settings(tmp_path, CONFIG)
    none, tenant, wrong, admin_basic = get(
        settings, ("/dashboard", {}), ("/dashboard", {"authorization": f"Bearer {TENANT}"}),
        ("/dashboard", basic("nope")), ("/dashboard", basic(ADMIN)),
    )
    assert none.status_code == 401 and none.headers["www-authenticate"].startswith("Basic realm=")
    assert none.json()["error"]["type"] == "authentication_error"
    assert tenant.status_code == 403 and tenant.json()["error"]["code"] == "admin_key_required"
    assert wrong.status_code == 401
    assert admin_basic.status_code == 200 and "<title>prefixgate dashboard</title>" in admin_basic.text


def test_open_mode_serves_the_page_and_bad_hours_are_a_400(tmp_path):
    settings = make_settings(tmp_path)
    page, bad = get(settings, ("/dashboard?hours=24", {}), ("/dashboard?hours=0", {}))
    assert page.status_code == 200 and island(page.text)["hours"] == 24
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "hours"


def test_page_headers_and_no_way_out_of_the_data_island(tmp_path):
    settings = make_settings(tmp_path)
    seed(settings.db_url)
    engine = database.create_db_engine(settings.db_url)
    with engine.begin() as connection:
        connection.execute(insert(request_log), [{
            "time": datetime.now(UTC).replace(tzinfo=None), "tenant": "alpha", "endpoint": "chat.completions",
            "model": "</script><script>alert(1)</script>", "upstream": "http://u", "status": 200,
            "stream": True, "ttft_ms": 99999.0, "latency_ms": 1.0, "warning_codes": ""}])
    engine.dispose()
    (page,) = get(settings, ("/dashboard", {}))
    csp = page.headers["content-security-policy"]
    nonce = re.search(r"'nonce-([^']+)'", csp).group(1)
    assert "default-src 'none'" in csp and f'<script nonce="{nonce}">' in page.text
    assert page.text.count("</script>") == 2  # the island and the page's own script
    assert island(page.text)["slowest"][0]["model"] == "</script><script>alert(1)</script>"


def test_parse_hours():
    assert parse_hours(None) == 168 and parse_hours("1") == 1
    for bad in ("0", "-3", "1.5", "x", str(90 * 24 + 1)):
        with pytest.raises(ValueError, match="hours"):
            parse_hours(bad)


def open_rows(now: datetime, keys: list[str]) -> list[dict[str, Any]]:
    """One streamed row per key in open mode (tenant ``open_tenant_id(key)``), key i sending i+1 rows."""
    from gateway.policy.tenant_names import open_tenant_id

    return [{"time": now - timedelta(minutes=i % 50), "tenant": open_tenant_id(key), "endpoint": "chat.completions",
             "model": "smol", "upstream": "http://u", "status": 200, "stream": True, "prompt_tokens": 100,
             "cached_tokens": 10 * (i % 10), "completion_tokens": 5, "ttft_ms": 10.0 + i, "latency_ms": 50.0 + i,
             "warning_codes": ""}
            for i, key in enumerate(keys) for _ in range(i + 1)]


def test_open_mode_tenants_are_labelled_and_charted_top_ten_plus_others(tmp_path):
    from gateway.policy.tenant_names import label_of_key, open_tenant_id

    settings = make_settings(tmp_path)
    now = seed(settings.db_url)
    keys = [f"sk-user-{i:02d}-secret" for i in range(25)]
    legacy = "open-" + open_tenant_id(keys[24])[5:17]  # the same key's id as versions before 128 bits wrote it
    engine = database.create_db_engine(settings.db_url)
    with engine.begin() as connection:
        connection.execute(insert(request_log), open_rows(now, keys))
        connection.execute(insert(request_log), [{**open_rows(now, keys[24:])[0], "tenant": legacy}])
    engine.dispose()
    (page,) = get(settings, ("/dashboard", {}))
    data = island(page.text)
    for key in keys:
        assert key not in page.text and open_tenant_id(key) not in page.text
    assert legacy not in page.text
    labels = {label_of_key(key) for key in keys}
    assert labels <= set(data["tenants"]) and len(labels) == 25
    assert data["tenants"][label_of_key(keys[24])]["requests"] == 26  # 25 rows + the legacy one, merged
    # The ten busiest tenants have their own line, the other 18 (15 keys, alpha, beta, unauthenticated) one.
    busiest = [label_of_key(key) for key in reversed(keys[15:])]
    assert list(data["series"]) == [*sorted(busiest), "(others)"]
    others = data["series"]["(others)"]
    in_others = [t for name, t in data["tenants"].items() if name not in data["series"]]
    assert sum(p["requests"] for p in others) == sum(t["requests"] for t in in_others)
    assert {entry["tenant"] for entry in data["slowest"]} == {"alpha", label_of_key(keys[24])}
