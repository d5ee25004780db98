"""EngineProcess (the child of `prefixgate serve`) with stand-in child commands."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from support.net import free_port

from gateway.server.engine_process import MAX_RESTARTS, EngineProcess, EngineStartError


def process_running(code: str) -> EngineProcess:
    engine = EngineProcess(free_port())
    engine.command = [sys.executable, "-c", code]
    engine.start()
    return engine


def test_a_child_that_exits_fails_the_health_wait_at_once():
    engine = process_running("import sys; sys.exit(3)")
    with pytest.raises(EngineStartError, match="status 3"):
        engine.wait_healthy(timeout_s=600)
    assert engine.stop() == 3


def test_a_child_that_never_gets_healthy_hits_the_bound():
    engine = process_running("import time; time.sleep(600)")
    try:
        with pytest.raises(EngineStartError, match="not healthy"):
            engine.wait_healthy(timeout_s=0.5, poll_s=0.05)
    finally:
        assert engine.stop(grace_s=10) is not None
    assert engine.process.poll() is not None


# A stand-in engine: answers 200 to every GET on its port, exits 0 on SIGTERM (as uvicorn does).
STAND_IN = """
import http.server, signal, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.send_header("content-length", "0"); self.end_headers()
    def log_message(self, *a): pass
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
http.server.HTTPServer(("127.0.0.1", {port}), H).serve_forever()
"""


def wait_for(condition, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_a_child_that_exits_even_with_status_0_is_restarted_on_its_port():
    port = free_port()
    engine = EngineProcess(port)
    engine.command = [sys.executable, "-c", STAND_IN.format(port=port)]
    gave_up = []
    engine.start()
    try:
        engine.wait_healthy(timeout_s=60, poll_s=0.05)
        engine.supervise(gave_up.append, healthy_timeout_s=60, backoff_s=0.05)
        first = engine.process
        first.send_signal(signal.SIGTERM)
        assert first.wait(60) == 0
        wait_for(lambda: engine.restarts == 1 and engine.process is not first, "no restart")
        engine.wait_healthy(timeout_s=60, poll_s=0.05)  # the new child answers on the same port
    finally:
        assert engine.stop(grace_s=10) == 0
    assert gave_up == [] and engine.process.poll() == 0


def test_a_child_that_keeps_dying_makes_the_supervisor_give_up():
    engine = process_running("import sys; sys.exit(0)")
    reasons, done = [], threading.Event()
    engine.supervise(lambda reason: (reasons.append(reason), done.set()), healthy_timeout_s=30, backoff_s=0.01)
    assert done.wait(120)
    assert engine.restarts == MAX_RESTARTS and "status 0" in reasons[0], reasons
    engine.stop()


def test_stop_ends_supervision_without_a_restart():
    engine = process_running("import time; time.sleep(600)")
    reasons = []
    thread = engine.supervise(reasons.append, healthy_timeout_s=30, backoff_s=0.01)
    engine.stop(grace_s=10)
    thread.join(60)
    assert not thread.is_alive() and engine.restarts == 0 and reasons == []


def test_the_child_dies_with_its_parent_even_after_sigkill(tmp_path):
    parent_code = f"""
import sys, time
sys.path.insert(0, {os.getcwd()!r})
from gateway.server.engine_process import EngineProcess
engine = EngineProcess(1)
engine.command = [sys.executable, "-c", "import time; time.sleep(600)"]
engine.start()
print(engine.process.pid, flush=True)
time.sleep(600)
"""
    parent = subprocess.Popen([sys.executable, "-c", parent_code], stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        assert os.path.exists(f"/proc/{child}")
        parent.kill()
        parent.wait(60)
        wait_for(lambda: not _alive(child), "the child outlived its parent's SIGKILL")
    finally:
        if parent.poll() is None:
            parent.kill()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


def test_each_run_draws_a_key_given_to_the_child_in_its_environment_only(tmp_path):
    out = tmp_path / "env"
    engine = process_running(
        f"import os, pathlib; pathlib.Path({str(out)!r}).write_text(os.environ['PREFIXGATE_ENGINE_API_KEY'])")
    assert engine.process.wait(60) == 0
    assert out.read_text() == engine.api_key and len(engine.api_key) >= 43  # 256 bits, url-safe
    assert engine.api_key not in " ".join(engine.command)
    assert EngineProcess(free_port()).api_key != engine.api_key


@pytest.mark.parametrize("arg", ["--api-key=mine", "--api-key"])
def test_an_engine_key_of_ones_own_is_refused(arg):
    with pytest.raises(ValueError, match="per run"):
        EngineProcess(free_port(), [arg])
