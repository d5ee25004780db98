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
