"""The first start announces the one-time model conversion and reports progress while
its long steps run (engine.model_store); later starts say nothing about it."""

from __future__ import annotations

import logging
import threading
import time

from engine import model_store


def test_the_conversion_is_announced_once(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("PREFIXGATE_HOME", str(tmp_path))

    def convert(gguf, out_dir):
        for name in model_store.REQUIRED_FILES:
            (out_dir / name).write_text(name)

    monkeypatch.setattr(model_store, "_convert", convert)
    gguf = tmp_path / "Tiny.gguf"
    gguf.write_bytes(b"GGUF")
    with caplog.at_level(logging.INFO, logger="engine.model_store"):
        model_store.ensure_converted_model(gguf)
        first = [r.getMessage() for r in caplog.records]
        caplog.clear()
        model_store.ensure_converted_model(gguf)
        second = [r.getMessage() for r in caplog.records]
    (announcement,) = [m for m in first if m.startswith("first start: converting")]
    assert "Tiny.gguf" in announcement and "about a minute" in announcement
    assert str(tmp_path / "models" / "Tiny") in announcement
    assert second == []


class _Seen(logging.Handler):
    def __init__(self, needle: str) -> None:
        super().__init__()
        self.needle = needle
        self.event = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if self.needle in record.getMessage():
            self.event.set()


def test_a_long_step_logs_a_heartbeat_until_it_ends():
    log = logging.getLogger("engine.model_store")
    seen = _Seen("still dequantizing the weights")
    log.addHandler(seen)
    old_level = log.level
    log.setLevel(logging.INFO)
    try:
        with model_store.heartbeat("dequantizing the weights", time.monotonic(), every_s=0.01):
            # The step "runs" until a progress line has been logged (bounded wait).
            assert seen.event.wait(30), "no progress line while the step ran"
        # Leaving the block stops and joins the heartbeat thread.
        assert "prefixgate-convert-progress" not in [thread.name for thread in threading.enumerate()]
    finally:
        log.removeHandler(seen)
        log.setLevel(old_level)
