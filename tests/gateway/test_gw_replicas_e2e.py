"""End to end: `prefixgate serve --replicas 2` (two real engines publishing KV events, the
bundled model) and the official openai SDK. The gateway's predicted cached tokens equal
what the engines report, each tenant's conversation stays where its prefix is, another
tenant's blocks never attract a request, and killing a replica loses no request that
had not reached it while its blocks leave the index."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest
from gw_fakes import rows, wait_healthy
from support.net import free_port

from gateway.stats.database import default_db_url

pytestmark = pytest.mark.real_model

MODEL = "SmolLM2-135M-Instruct"


def system_prompt(tenant: str) -> str:
    return f"You are the assistant of team {tenant}. " + "Answer in one short and polite sentence. " * 30


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    data = tmp_path_factory.mktemp("replicas")
    port, engine_port = free_port(), free_port()
    METRICS_PORT[0] = free_port()
    # Consecutive ports must be free too; free_port() only checks one, so pick a high base.
    engine_port = 20000 + engine_port % 20000
    process = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "serve", "--replicas", "2", "--port", str(port),
         "--engine-port", str(engine_port), "--data-dir", str(data),
         "--health-interval", "60", "--engine-arg=--kv-cache-memory=0.05", "--log-level", "warning",
         "--metrics-port", str(METRICS_PORT[0])],
        env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, process, name="prefixgate serve --replicas 2", timeout=900, interval=0.5)
        yield url, data, engine_port
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(120)
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)


METRICS_PORT = [0]
"""The loopback port of the gateway's unauthenticated /metrics (its own needs an admin key)."""

ASKED = [0]
"""Requests sent through the gateway by this module's tests so far (each writes one stats row)."""


def ask(url: str, tenant: str, question: str, stream: bool = False, system: str | None = None) -> tuple[int, int]:
    ASKED[0] += 1
    client = openai.OpenAI(base_url=url + "/v1", api_key=f"key-{tenant}", max_retries=0, timeout=300)
    messages = [{"role": "system", "content": system or system_prompt(tenant)}, {"role": "user", "content": question}]
    if stream:
        chunks = list(client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=3, temperature=0, stream=True,
            stream_options={"include_usage": True}))
        usage = chunks[-1].usage
    else:
        usage = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, temperature=0).usage
    assert usage is not None
    return usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens


def logged_rows(data, count: int) -> list:
    """The stats rows once at least ``count`` are written (the writer batches in the background)."""
    deadline = time.monotonic() + 60
    while True:
        found = rows(default_db_url(data))
        if len(found) >= count:
            return found
        assert time.monotonic() < deadline, f"only {len(found)} of {count} rows were written"
        time.sleep(0.1)


def wait_dead(pid: int) -> None:
    """Return once ``pid`` has exited (gone or a zombie): its sockets are closed by then.
    ``os.kill`` only queues SIGKILL; the process may still read a request after it returns."""
    deadline = time.monotonic() + 60
    while True:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                if stat.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                    return
        except FileNotFoundError:
            return
        assert time.monotonic() < deadline, f"process {pid} survived SIGKILL for 60 s"
        time.sleep(0.01)


def metric(url: str, name: str, replica: str) -> float:
    text = httpx.get(f"http://127.0.0.1:{METRICS_PORT[0]}/metrics", timeout=30).text
    found = re.search(rf'^{name}\{{replica="{replica}"\}} (\S+)$', text, re.M)
    assert found, name
    return float(found.group(1))


def test_predictions_are_exact_and_conversations_stay_with_their_prefix(served) -> None:
    url, data, _ = served
    before = len(logged_rows(data, ASKED[0]))
    for turn in range(3):
        for tenant in ("north", "south", "east", "west"):
            prompt, cached = ask(url, tenant, f"Question number {turn}?", stream=turn == 1)
            if turn:
                assert cached >= prompt - 40, (tenant, turn, prompt, cached)  # the system prompt was reused
    logged = [r for r in logged_rows(data, ASKED[0])[before:] if r.predicted_cached_tokens is not None]
    assert len(logged) == 12
    assert [r.predicted_cached_tokens for r in logged] == [r.cached_tokens for r in logged]
    assert {r.replica for r in logged} == {"r0", "r1"}  # the load is spread over both replicas


def test_another_tenants_cached_prompt_attracts_nothing(served) -> None:
    url, data, _ = served
    shared = system_prompt("shared")
    _, warm = ask(url, "copy-a", "Same question?", system=shared)
    _, hit = ask(url, "copy-a", "Same question?", system=shared)
    assert warm == 0 and hit > 200  # tenant A's prompt is cached on its replica
    _, cached = ask(url, "copy-b", "Same question?", system=shared)  # same text, another tenant: another salt
    assert cached == 0
    last = logged_rows(data, ASKED[0])[-1]
    assert last.predicted_cached_tokens == 0 and last.cached_tokens == 0


def test_killing_a_replica_loses_no_request_that_had_not_reached_it(served) -> None:
    url, data, engine_port = served
    before = len(logged_rows(data, ASKED[0]))  # whichever of this module's tests ran before
    for tenant in ("one", "two", "three", "four"):
        ask(url, tenant, "Warm up?")
    warm = logged_rows(data, before + 4)[before:]
    assert "r1" in {r.replica for r in warm}  # some of these conversations live on r1
    assert metric(url, "prefixgate_replica_index_blocks", "r1") > 0
    victim = subprocess.run(["pgrep", "-f", f"engine --host 127.0.0.1 --port {engine_port + 1}"],
                            capture_output=True, text=True).stdout.split()
    assert victim
    for pid in victim:
        os.kill(int(pid), signal.SIGKILL)
    for pid in victim:
        wait_dead(int(pid))
    before += 4
    # The health check runs every 60 s here, so requests still get routed to the dead replica
    # first: their connection is refused before anything is sent, and they go to r0. (serve
    # restarts the killed engine after a back-off; until a health check sees it, r1 stays out.)
    for tenant in ("one", "two", "three", "four"):
        ask(url, tenant, "After the crash?")
    after = logged_rows(data, before + 4)[before:]
    assert [r.status for r in after] == [200] * 4
    assert metric(url, "prefixgate_replica_unreachable_total", "r1") >= 1
    if metric(url, "prefixgate_replica_healthy", "r1") == 0:  # not back yet: its blocks left the index
        assert {r.replica for r in after} == {"r0"}
        assert metric(url, "prefixgate_replica_index_blocks", "r1") == 0
