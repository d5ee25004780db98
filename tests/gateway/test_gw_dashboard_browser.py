"""The dashboard in headless Chromium (Debian's package; .ci/run installs it): the page
renders the data of a real SQLite file, the admin key works from the browser, and
the console stays clean (no errors, no CSP violations).

``PREFIXGATE_UPDATE_SCREENSHOTS=1`` also writes docs/dashboard.png."""

from __future__ import annotations

import os
import random
from datetime import timedelta
from pathlib import Path

import httpx
import pytest
from gw_chromium import chromium, chromium_binary
from gw_fakes import make_settings, serve_in_thread
from sqlalchemy import insert, text
from test_gw_dashboard import ADMIN, CONFIG, open_rows, seed

from gateway.policy.tenant_names import label_of_key, open_tenant_id
from gateway.server.app import create_app
from gateway.stats import database
from gateway.stats.table import request_log

pytestmark = [
    pytest.mark.skipif(chromium_binary() is None, reason="no Chromium here (apt-get install chromium)"),
]
pytest.importorskip("websocket", reason="websocket-client is a test extra")
SCREENSHOT = Path(__file__).resolve().parents[2] / "docs" / "dashboard.png"


def more_traffic(db_url: str, now) -> None:
    """A day of a third tenant whose hit rate climbs as its prefixes are fixed (deterministic)."""
    rng = random.Random(14)
    rows = []
    for hours_ago in range(24, 0, -1):
        for _ in range(4):
            prompt = rng.randint(800, 2400)
            cached = int(prompt * min(0.95, 0.2 + 0.03 * (24 - hours_ago)) // 16 * 16)
            ttft = 40 + (prompt - cached) * 0.4
            rows.append({
                "time": now - timedelta(hours=hours_ago, minutes=rng.randint(0, 50)), "tenant": "gamma",
                "endpoint": "chat.completions", "model": "smol", "upstream": "http://u", "status": 200,
                "stream": True, "prompt_tokens": prompt, "cached_tokens": cached, "completion_tokens": 20,
                "ttft_ms": ttft, "latency_ms": ttft + 360.0,
                "warning_codes": "PS101" if hours_ago > 12 else "",
            })
    engine = database.create_db_engine(db_url)
    with engine.begin() as connection:
        connection.execute(insert(request_log), rows)
    engine.dispose()


def expected(db_url: str, since) -> tuple[str, float]:
    """The overall hit rate and the slowest TTFT straight from the file, by plain SQL."""
    engine = database.create_db_engine(db_url)
    with engine.connect() as connection:
        cached, prompt = connection.execute(text(
            "SELECT sum(cached_tokens), sum(prompt_tokens) FROM request_log "
            "WHERE cached_tokens IS NOT NULL AND time >= :since"), {"since": since}).one()
        slowest = connection.execute(text("SELECT max(ttft_ms) FROM request_log WHERE stream AND time >= :since"),
                                     {"since": since}).scalar_one()
    engine.dispose()
    return f"{100 * cached / prompt:.1f}%", slowest


def test_dashboard_renders_a_real_database_without_console_errors(tmp_path):
    settings = make_settings(tmp_path, CONFIG)
    now = seed(settings.db_url)
    more_traffic(settings.db_url, now)
    app = create_app(settings, httpx.AsyncClient(transport=httpx.MockTransport(lambda r: httpx.Response(500))))
    with serve_in_thread(app) as url, chromium(tmp_path / "profile") as page:
        page.call("Network.setExtraHTTPHeaders", headers={"Authorization": f"Bearer {ADMIN}"})
        page.call("Page.navigate", url=url + "/dashboard")
        page.wait_for("Page.loadEventFired")
        assert page.evaluate("document.body.dataset.rendered") == "true"
        assert page.evaluate("document.title") == "prefixgate dashboard"
        hit_rate, slowest_ttft = expected(settings.db_url, (now - timedelta(hours=168)).replace(minute=0))
        assert page.evaluate("document.querySelector('[data-card=\"Hit rate\"]').textContent") == hit_rate
        lines = page.evaluate(
            "[...document.querySelectorAll('#hit-rate-chart polyline')].map(p => p.dataset.tenant)")
        assert lines == ["alpha", "beta", "gamma"]
        tenants = page.evaluate("[...document.querySelectorAll('#tenants tbody tr')]"
                                ".map(r => [...r.cells].map(c => c.textContent))")
        assert tenants[0][0] == "(unauthenticated)" and tenants[1][:2] == ["alpha", "2"]
        assert tenants[1][5] == "76.7%"
        warnings = page.evaluate("[...document.querySelectorAll('#warnings tbody tr')]"
                                 ".map(r => [...r.cells].map(c => c.textContent))")
        assert warnings[0] == ["PS101", "50"]  # 2 seeded + 48 of gamma's first half day
        slowest = page.evaluate("document.querySelector('#slowest tbody tr').cells[3].textContent")
        assert slowest == f"{slowest_ttft:.1f}"
        legend = page.evaluate("[...document.querySelectorAll('#hit-rate-chart .legend > span')].map(s => s.textContent)")
        assert legend == ["alpha", "beta", "gamma"]  # no line, no legend entry
        shot = tmp_path / "dashboard.png"
        page.screenshot(shot)
        assert page.problems() == []
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    if os.environ.get("PREFIXGATE_UPDATE_SCREENSHOTS") == "1":
        SCREENSHOT.write_bytes(shot.read_bytes())


def test_twenty_five_open_mode_tenants_get_labels_and_distinct_colours(tmp_path):
    """Open mode, 25 keys: every tenant is named by its short label (what ``prefixgate keys
    label`` prints), never by its key or full id; the charts draw the ten busiest and
    "(others)", each line in a colour of its own, the legend and the table agree."""
    settings = make_settings(tmp_path)
    now = seed(settings.db_url)
    keys = [f"sk-user-{i:02d}-secret" for i in range(25)]
    engine = database.create_db_engine(settings.db_url)
    with engine.begin() as connection:
        connection.execute(insert(request_log), open_rows(now, keys))
    engine.dispose()
    app = create_app(settings, httpx.AsyncClient(transport=httpx.MockTransport(lambda r: httpx.Response(500))))
    with serve_in_thread(app) as url, chromium(tmp_path / "profile") as page:
        page.call("Page.navigate", url=url + "/dashboard")
        page.wait_for("Page.loadEventFired")
        assert page.evaluate("document.body.dataset.rendered") == "true"
        shown = page.evaluate("document.body.innerText")
        for key in keys:
            assert key not in shown and open_tenant_id(key) not in shown
        tenants = page.evaluate("[...document.querySelectorAll('#tenants tbody tr')].map(r => r.cells[0].textContent)")
        assert len(tenants) == 28 and {label_of_key(key) for key in keys} <= set(tenants)
        for chart in ("hit-rate-chart", "cached-chart"):
            lines = page.evaluate(f"[...document.querySelectorAll('#{chart} polyline')]"
                                  ".map(p => [p.dataset.tenant, p.getAttribute('stroke')])")
            assert [name for name, _ in lines] == [*sorted(label_of_key(k) for k in keys[15:]), "(others)"]
            assert len({colour for _, colour in lines}) == 11, lines  # no colour used twice
            legend = page.evaluate(f"[...document.querySelectorAll('#{chart} .legend > span')]"
                                   ".map(s => [s.textContent, s.dataset.color])")
            assert legend == lines
        swatches = page.evaluate("[...document.querySelectorAll('#tenants tbody tr')]"
                                 ".filter(r => r.querySelector('.swatch')).map(r => r.cells[0].textContent)")
        assert sorted(swatches) == sorted(label_of_key(k) for k in keys[15:])
        slowest = page.evaluate("[...document.querySelectorAll('#slowest tbody tr')]"
                                ".map(r => [...r.cells].map(c => c.textContent))")
        assert slowest[0][1] == "alpha" and slowest[0][3:5] == ["950.5", "1901.0"]  # TTFT, latency beside it
        assert slowest[2][1] == label_of_key(keys[24]) and slowest[2][3:5] == ["34.0", "74.0"]
        assert all(row[1] != "beta" for row in slowest)  # beta's only timed request was not streamed
        page.screenshot(tmp_path / "many.png")
        if os.environ.get("PREFIXGATE_KEEP_SCREENSHOT"):
            (Path(os.environ["PREFIXGATE_KEEP_SCREENSHOT"])).write_bytes((tmp_path / "many.png").read_bytes())
        assert page.problems() == []
