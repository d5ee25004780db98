"""``prefixgate gateway --workers N`` as real processes: shared warning history, summed
metrics, every stats row on SIGTERM, and bounded row loss on SIGKILL."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest
from gw_fakes import FakeUpstream, rows, serve_in_thread, wait_healthy
from support.net import free_port

from gateway.stats.database import default_db_url
from gateway.stats.writer import FLUSH_INTERVAL_S

CLI = [sys.executable, "-m", "gateway.cli"]


def start_gateway(upstream_url: str, tmp_path, workers: int, *extra: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    process = subprocess.Popen(
        [*CLI, "gateway", "--upstream", upstream_url, "--data-dir", str(tmp_path), "--port", str(port),
         "--workers", str(workers), "--log-level", "warning", *extra],
        stderr=subprocess.PIPE, text=True, env={**os.environ, "PREFIXGATE_SECRET": "workers-test-secret-0123"},
    )
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, process, name="gateway")
    return process, url


def post_fresh(url: str, body: dict) -> httpx.Response:
    """One request on its own connection (the kernel picks the worker)."""
    with httpx.Client(base_url=url, headers={"authorization": "Bearer me"}, timeout=30) as client:
        response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response


def test_workers_share_history_and_metrics_and_write_every_row(tmp_path):
    upstream = FakeUpstream()
    with serve_in_thread(upstream.app) as upstream_url:
        metrics_port = free_port()
        process, url = start_gateway(upstream_url, tmp_path, 2, "--metrics-port", str(metrics_port))
        try:
            conversations = 24
            for i in range(conversations):
                question = {"role": "user", "content": f"Where is order {i}?"}
                # an edited system prompt is a break only within a named conversation
                thread = {"conversation_id": f"order-{i}"}
                post_fresh(url, {"model": "fake-model", "metadata": thread, "messages": [
                    {"role": "system", "content": "You are the shop's assistant."}, question]})
                edited = post_fresh(url, {"model": "fake-model", "metadata": thread, "messages": [
                    {"role": "system", "content": "You are the shop's helpful assistant."}, question,
                    {"role": "assistant", "content": "It ships today."},
                    {"role": "user", "content": "Thanks"}]})
                # the second turn may reach the other worker: the history is shared
                codes = edited.headers.get("x-prefixgate-warnings", "")
                assert re.search(r"PS2\d\d", codes), (i, codes)
            for _ in range(4):  # no worker shows the totals without a key
                assert httpx.get(url + "/metrics").status_code == 401
            for _ in range(2):  # the supervisor's loopback listener sums every worker's counts
                metrics = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics").text
                total = sum(float(value) for value in re.findall(
                    r'^prefixgate_requests_total\{endpoint="chat.completions",status="200"\} (\S+)$',
                    metrics, re.MULTILINE))
                assert total == 2 * conversations, metrics[:2000]
            process.send_signal(signal.SIGTERM)
            _, stderr = process.communicate(timeout=60)
        finally:
            if process.poll() is None:
                process.kill()
    assert process.returncode == 0, stderr
    logged = rows(default_db_url(tmp_path))
    assert len(logged) == 2 * conversations and {r.status for r in logged} == {200}


def test_sigkill_loses_at_most_the_rows_of_the_last_flush_interval(tmp_path):
    upstream = FakeUpstream()
    slack = 1.0  # scheduling on a busy machine; the bound itself is FLUSH_INTERVAL_S
    with serve_in_thread(upstream.app) as upstream_url:
        process, url = start_gateway(upstream_url, tmp_path, workers=1)
        answered: list[float] = []
        try:
            with httpx.Client(base_url=url, headers={"authorization": "Bearer me"}, timeout=30) as client:
                deadline = time.monotonic() + FLUSH_INTERVAL_S + slack + 1.0
                while time.monotonic() < deadline:
                    body = {"model": "fake-model", "messages": [{"role": "user", "content": "q"}]}
                    assert client.post("/v1/chat/completions", json=body).status_code == 200
                    answered.append(time.monotonic())
            process.send_signal(signal.SIGKILL)
            killed = time.monotonic()
            process.communicate(timeout=60)
        finally:
            if process.poll() is None:
                process.kill()
    written = len(rows(default_db_url(tmp_path)))
    # requests were sequential and rows are written in order: the lost ones are the last ones
    assert written <= len(answered)
    old_enough = sum(1 for t in answered if t < killed - FLUSH_INTERVAL_S - slack)
    assert written >= old_enough > 0, (written, old_enough, len(answered))


def test_workers_must_be_a_positive_number(tmp_path):
    done = subprocess.run([*CLI, "gateway", "--upstream", "http://127.0.0.1:1", "--data-dir", str(tmp_path),
                           "--workers", "0"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--workers" in done.stderr and "Traceback" not in done.stderr


def test_settle_heap_freezes_the_start_up_heap_and_collects_the_young_generation_less_often():
    import gc

    from gateway.server.process_setup import settle_heap

    threshold = gc.get_threshold()
    try:
        settle_heap(young_threshold=12_345)
        assert gc.get_freeze_count() > 1000  # the modules and objects built so far
        assert gc.get_threshold() == (12_345, *threshold[1:])
    finally:
        gc.unfreeze()
        gc.set_threshold(*threshold)


def test_share_the_gil_shortens_the_switch_interval():
    import sys

    from gateway.server.process_setup import SWITCH_INTERVAL_S, share_the_gil

    before = sys.getswitchinterval()
    try:
        share_the_gil()
        assert abs(sys.getswitchinterval() - SWITCH_INTERVAL_S) < 1e-9
        assert before > SWITCH_INTERVAL_S
    finally:
        sys.setswitchinterval(before)


def _children(pid: int) -> list[int]:
    return [int(child) for task in os.listdir(f"/proc/{pid}/task")
            for child in open(f"/proc/{pid}/task/{task}/children").read().split()]


def _server_sockets(port: int, state: str) -> set[str]:
    """Inodes of the IPv4 TCP sockets on local ``port`` in ``state`` (0A listen, 01 established)."""
    with open("/proc/net/tcp") as table:
        rows = [line.split() for line in table.readlines()[1:]]
    return {row[9] for row in rows if row[1].endswith(f":{port:04X}") and row[3] == state}


def _sockets_of(pid: int, inodes: set[str]) -> int:
    found = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            found += os.readlink(f"/proc/{pid}/fd/{fd}").removeprefix("socket:[").removesuffix("]") in inodes
    return found


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_each_worker_listens_on_its_own_socket_and_connections_reach_both(tmp_path):
    """Connections opened together (wrk's) were all accepted by whichever worker woke first."""
    upstream = FakeUpstream()
    with serve_in_thread(upstream.app) as upstream_url:
        process, url = start_gateway(upstream_url, tmp_path, workers=2)
        port = int(url.rsplit(":", 1)[1])
        clients = []
        try:
            deadline = time.monotonic() + 30
            # One listening socket per worker (the supervisor's only holds the port); /health
            # answered as soon as the first worker listened, so wait for the second.
            while len(_server_sockets(port, "0A")) < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert len(_server_sockets(port, "0A")) == 2
            clients = [socket.create_connection(("127.0.0.1", port)) for _ in range(32)]
            workers = _children(process.pid)
            deadline = time.monotonic() + 30
            while True:  # until the workers have accepted all 32
                accepted = [_sockets_of(pid, _server_sockets(port, "01")) for pid in workers]
                if sum(accepted) >= 32 or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            assert sum(accepted) == 32 and sorted(accepted)[-2] > 0, accepted
        finally:
            for client in clients:
                client.close()
            process.terminate()
            process.communicate(timeout=60)
