"""Fuzz: seeded malformed requests against the engine and the gateway in front of it.

Both servers run under uvicorn on loopback (the engine with an API key, the
gateway holding it, as ``prefixgate serve`` wires them). Every answer must be a
status below 500, OpenAI's error shape for a 4xx, and a well-formed body or
stream for a 200 (:func:`bad_requests.check_answer`). Afterwards the engine holds
no block and the gateway wrote one stats row per request. The seed changes each
day (printed, and settable with ``PREFIXGATE_FUZZ_SEED``) so runs cover new cases
while any failure can be replayed. ``benchmarks/fault_campaign.py`` runs thousands.
"""

from __future__ import annotations

import asyncio
import datetime
import os
import socket
import threading
from collections import Counter

import httpx
import pytest
import uvicorn
from bad_requests import cases, check_answer
from test_engine_http_fixtures import serve, wait_until

from gateway.app import create_app as create_gateway
from gateway.database import default_db_url, upgrade
from gateway.settings import GatewaySettings

CASES_PER_RUN = int(os.environ.get("PREFIXGATE_FUZZ_CASES") or 300)
KEY = "fuzz-engine-key"
SEED = int(os.environ.get("PREFIXGATE_FUZZ_SEED") or datetime.date.today().strftime("%Y%m%d"))


class _Gateway:
    """The gateway app under uvicorn in a thread (lifespan on: its stats writer runs)."""

    def __init__(self, settings: GatewaySettings) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        config = uvicorn.Config(create_gateway(settings), log_level="warning", access_log=False, lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        wait_until(lambda: self.server.started, 60, "the gateway to start")
        return self.url

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(60)
        self.sock.close()


async def _send_all(url: str, all_cases, headers: dict[str, str]) -> list[tuple[object, int, bytes]]:
    limits = httpx.Limits(max_connections=8)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
        semaphore = asyncio.Semaphore(8)

        async def one(case):
            async with semaphore:
                response = await client.post(case.path, content=case.body,
                                             headers={"content-type": "application/json", **headers})
                return case, response.status_code, response.content

        return await asyncio.gather(*(one(case) for case in all_cases))


@pytest.fixture
def servers(tiny_engine, tmp_path):
    with serve(tiny_engine, api_key=KEY, max_body_bytes=2 * 1024 * 1024) as engine:
        db_url = default_db_url(tmp_path)
        upgrade(db_url)
        settings = GatewaySettings(upstream=engine.base_url, secret=b"fuzz-secret-0123456789abcdef0123",
                                   db_url=db_url, data_dir=tmp_path, upstream_api_key=KEY)
        with _Gateway(settings) as gateway:
            yield engine.base_url, gateway, db_url


def test_no_malformed_request_gets_a_5xx_from_either_server(servers, tiny_engine):
    engine_url, gateway_url, _db_url = servers
    all_cases = list(cases(SEED, CASES_PER_RUN, tiny_engine.model_id))
    print(f"fuzz seed {SEED} (PREFIXGATE_FUZZ_SEED={SEED} replays it)")
    failures: list[str] = []
    statuses: Counter[tuple[str, int]] = Counter()
    for name, url in (("engine", engine_url), ("gateway", gateway_url)):
        answers = asyncio.run(_send_all(url, all_cases, {"authorization": f"Bearer {KEY}"}))
        for case, status, content in answers:
            statuses[(name, status)] += 1
            problem = check_answer(status, content)
            if problem is not None:
                failures.append(f"{name} case {case.index} ({case.kind}, {case.path}): {problem}\n"
                                f"  body: {case.body[:300]!r}")
    print(sorted(statuses.items()))
    assert not failures, f"seed {SEED}: {len(failures)} bad answers\n" + "\n".join(failures[:20])
    # Some cases are served, most are refused: the generator exercises both paths.
    assert statuses[("engine", 200)] > 10 and statuses[("engine", 400)] > 100
    kv = tiny_engine.kv_cache_manager
    wait_until(lambda: kv.num_free_blocks == kv.num_blocks, 30, "every block back in the free queue")
    kv.check_integrity()


def test_gateway_wrote_one_row_per_fuzzed_request(servers, tiny_engine):
    _engine_url, gateway_url, db_url = servers
    few = list(cases(SEED + 1, 60, tiny_engine.model_id))
    answers = asyncio.run(_send_all(gateway_url, few, {"authorization": "Bearer tenant-key"}))
    assert all(check_answer(status, content) is None for _, status, content in answers)
    from sqlalchemy import func, select

    from gateway.database import create_db_engine
    from gateway.stats_table import request_log

    def written() -> int:
        engine = create_db_engine(db_url)
        try:
            with engine.connect() as connection:
                return int(connection.execute(select(func.count()).select_from(request_log)).scalar_one())
        finally:
            engine.dispose()

    wait_until(lambda: written() == len(few), 30, "one stats row per request")
