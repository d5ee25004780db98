"""EngineProcess (the child of `prefixgate serve`) with stand-in child commands."""

from __future__ import annotations

import sys
import threading

import pytest
from gw_fakes import free_port

from gateway.engine_process import EngineProcess, EngineStartError


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


def test_watch_reports_an_unexpected_exit_but_not_a_stop():
    engine = process_running("import time; time.sleep(600)")
    seen, done = [], threading.Event()
    engine.watch(lambda status: (seen.append(status), done.set()))
    engine.process.kill()
    assert done.wait(60) and seen == [-9]
    quiet = process_running("import time; time.sleep(600)")
    calls = []
    quiet.watch(calls.append)
    quiet.stop(grace_s=10)
    assert calls == []
