"""End to end, real processes: `prefixgate serve --replicas 2` with the bundled model and the
official openai SDK.

* A SIGSTOPped engine: the streams in flight on it end with an error within 30 s (default
  idle timeout and probe), the others finish, and new requests go to the other replica.
* `kill -9` of `serve` (one engine still stopped): no engine process survives, no port stays
  held, and a new `serve` on the same ports starts at once and removes the dead run's
  runtime directory.
* An engine child that exits with status 0 is restarted: `serve` answers again, never 503
  for good.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from gw_fakes import wait_healthy
from support.net import free_port

from gateway.server.ports import ensure_free

pytestmark = pytest.mark.real_model

MODEL = "SmolLM2-135M-Instruct"


def start_serve(data: Path, port: int, engine_port: int, metrics_port: int, replicas: int) -> subprocess.Popen:
    process = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "serve", "--replicas", str(replicas), "--port", str(port),
         "--engine-port", str(engine_port), "--metrics-port", str(metrics_port), "--data-dir", str(data),
         "--health-interval", "60", "--engine-arg=--kv-cache-memory=0.05", "--log-level", "warning"],
        env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
    )
    try:
        wait_healthy(f"http://127.0.0.1:{port}", process, name="prefixgate serve", timeout=900, interval=0.5)
    except BaseException:
        process.kill()
        raise
    return process


def engine_pids(serve: subprocess.Popen) -> dict[int, int]:
    """Engine port -> pid, from the children of ``serve``."""
    children = subprocess.run(["pgrep", "-P", str(serve.pid)], capture_output=True, text=True).stdout.split()
    found = {}
    for pid in map(int, children):
        try:  # a child listed by pgrep may exit before its cmdline is read
            args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except (FileNotFoundError, ProcessLookupError):
            continue
        if b"engine" in args and b"--port" in args:
            found[int(args[args.index(b"--port") + 1])] = pid
    return found


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


def _bindable(port: int) -> bool:
    try:
        ensure_free("127.0.0.1", port, "test")
    except ValueError:
        return False
    return True


def wait_until(condition, what: str, timeout: float) -> float:
    """Seconds until ``condition()`` held (polled); fails after ``timeout``."""
    began = time.monotonic()
    while not condition():
        assert time.monotonic() - began < timeout, what
        time.sleep(0.05)
    return time.monotonic() - began


def metric(metrics_port: int, name: str, replica: str) -> float:
    text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=30).text
    found = re.search(rf'^{name}\{{replica="{replica}"\}} (\S+)$', text, re.M)
    assert found, name
    return float(found.group(1))


def client(url: str, tenant: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=f"key-{tenant}", max_retries=0, timeout=300)


def test_stopped_replica_killed_serve_and_restarted_engine(tmp_path) -> None:
    port, metrics_port = free_port(), free_port()
    engine_port = 20000 + free_port() % 20000  # two consecutive free ports, most likely
    url = f"http://127.0.0.1:{port}"
    serve = start_serve(tmp_path / "one", port, engine_port, metrics_port, replicas=2)
    pids = engine_pids(serve)
    try:
        assert sorted(pids) == [engine_port, engine_port + 1]
        # -- a SIGSTOPped replica: its in-flight streams end with an error within 30 s.
        first_chunk = [threading.Event() for _ in range(4)]
        leave = threading.Event()  # the streams on the replica that answers are closed by the client
        outcome: list[tuple[str, float] | None] = [None] * 4

        def stream(i: int) -> None:
            try:
                chunks = client(url, f"t{i}").chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": f"Team {i}: count from 1 to 500."}],
                    max_tokens=400, temperature=0, stream=True, extra_body={"ignore_eos": True})
                for _ in chunks:
                    first_chunk[i].set()
                    if leave.is_set():
                        chunks.close()
                        outcome[i] = ("left", time.monotonic())
                        return
                outcome[i] = ("ok", time.monotonic())
            except openai.APIError as exc:
                outcome[i] = (f"error: {exc}", time.monotonic())
            finally:
                first_chunk[i].set()

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
        for thread in threads:
            thread.start()
        try:
            for event in first_chunk:
                assert event.wait(600)
            assert all(o is None for o in outcome), outcome  # all four in flight
            on_r1 = metric(metrics_port, "prefixgate_replica_in_flight", "r1")
            assert 1 <= on_r1 <= 3, on_r1  # balanced over both replicas
            os.kill(pids[engine_port + 1], signal.SIGSTOP)
            stopped_at = time.monotonic()
            wait_until(lambda: sum(o is not None and o[0].startswith("error") for o in outcome) >= on_r1,
                       f"the {on_r1:.0f} streams on the stopped replica did not end", 120)
        finally:
            leave.set()
            for thread in threads:
                thread.join(600)
        after = [(o[0][:90], round(o[1] - stopped_at, 1)) for o in outcome if o is not None]
        print("outcomes, seconds after SIGSTOP:", after)
        errors = [o for o in after if o[0].startswith("error")]
        assert len(errors) == on_r1, after
        assert all(at < 30 for _, at in errors), after
        assert all("sent nothing" in message for message, _ in errors), after  # upstream_stalled
        for i in range(4):  # new requests go to the replica that answers
            answer = client(url, f"after{i}").chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3)
            assert answer.choices[0].message.content is not None
        assert metric(metrics_port, "prefixgate_replica_healthy", "r1") == 0
        assert metric(metrics_port, "prefixgate_replica_stalls_total", "r1") >= 1
        assert httpx.get(url + "/metrics", timeout=30).status_code == 401  # the gateway's own needs a key

        # -- kill -9 of serve, one engine still stopped: nothing survives, nothing stays held.
        events_dirs = {p for p in Path(tempfile.gettempdir()).glob("prefixgate-kv-events-*")
                       if p.stat().st_uid == os.getuid() and _owned_by(p, serve.pid)}
        assert len(events_dirs) == 1
        serve.kill()
        serve.wait(60)
        took = wait_until(lambda: not any(alive(pid) for pid in pids.values()), "an engine survived serve", 30)
        for p in (port, engine_port, engine_port + 1, metrics_port):  # released within moments
            wait_until(lambda p=p: _bindable(p), f"port {p} still held after kill -9 of serve", 10)
        print(f"engines gone {took:.2f} s after kill -9 of serve")
    finally:
        if serve.poll() is None:
            serve.kill()
        for pid in pids.values():
            if alive(pid):
                os.kill(pid, signal.SIGKILL)

    # -- a new serve on the same ports starts at once; the dead run's directory is removed.
    again = start_serve(tmp_path / "two", port, engine_port, metrics_port, replicas=1)
    try:
        assert not any(p.exists() for p in events_dirs)
        # -- an engine that exits with status 0 is restarted: the gateway answers again.
        (old,) = engine_pids(again).values()
        os.kill(old, signal.SIGTERM)
        wait_until(lambda: not alive(old), "the engine ignored SIGTERM", 60)
        wait_until(lambda: list(engine_pids(again).values()) not in ([], [old]), "no new engine", 60)
        wait_until(lambda: _answers(url), "serve kept failing after the engine exited 0", 600)
        assert again.poll() is None
    finally:
        again.send_signal(signal.SIGINT)
        try:
            assert again.wait(120) == 0
        finally:
            if again.poll() is None:
                again.kill()


def _owned_by(path: Path, pid: int) -> bool:
    try:
        return (path / ".owner").read_text().strip() == str(pid)
    except OSError:
        return False


def _answers(url: str) -> bool:
    try:
        answer = client(url, "back").chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    except openai.APIError:
        return False
    return answer.choices[0].message.content is not None
