"""The engine's HTTP server on loopback for the HTTP tests: ``live`` (the tiny engine
behind a real uvicorn server) and ``client`` (the official ``openai`` SDK pointed at it).
A module that needs other server settings defines its own ``live``."""

from __future__ import annotations

import openai
import pytest
from test_engine_http_fixtures import serve


@pytest.fixture
def live(tiny_engine):
    with serve(tiny_engine) as server:
        yield server


@pytest.fixture
def client(live):
    return openai.OpenAI(base_url=live.api_url, api_key="x", max_retries=0, timeout=120)
