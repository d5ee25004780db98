"""Headless Chromium driven over the DevTools protocol (websocket-client only).

:func:`chromium` starts Debian's ``chromium`` with a throw-away profile and yields a
:class:`Page` bound to its first tab. The page records every console message,
uncaught exception and browser log entry (CSP violations land there), so a test
can assert that a page loaded without errors.
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson

BINARIES = ("chromium", "chromium-browser", "google-chrome")


def chromium_binary() -> str | None:
    return next((path for name in BINARIES if (path := shutil.which(name))), None)


class Page:
    def __init__(self, ws_url: str) -> None:
        import websocket

        self.ws = websocket.create_connection(ws_url, timeout=60, suppress_origin=True)
        self.ids = itertools.count(1)
        self.events: list[dict[str, Any]] = []

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        """Send one command and return its result; events received meanwhile are kept."""
        call_id = next(self.ids)
        self.ws.send(orjson.dumps({"id": call_id, "method": method, "params": params}).decode())
        while True:
            message = orjson.loads(self.ws.recv())
            if message.get("id") == call_id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return dict(message.get("result", {}))
            self.events.append(message)

    def wait_for(self, event: str, timeout: float = 60.0) -> dict[str, Any]:
        """Block until ``event`` arrives (or was already received)."""
        deadline = time.monotonic() + timeout
        while True:
            for message in self.events:
                if message.get("method") == event:
                    return message
            assert time.monotonic() < deadline, f"no {event} within {timeout} s"
            self.events.append(orjson.loads(self.ws.recv()))

    def evaluate(self, expression: str) -> Any:
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        assert "exceptionDetails" not in result, result["exceptionDetails"]
        return result["result"].get("value")

    def problems(self) -> list[str]:
        """Console errors/warnings, uncaught exceptions and error log entries so far."""
        found = []
        for message in self.events:
            method, params = message.get("method"), message.get("params", {})
            if method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "warning", "assert"):
                found.append(f"console.{params['type']}: {params.get('args')}")
            elif method == "Runtime.exceptionThrown":
                found.append(f"exception: {params.get('exceptionDetails')}")
            elif method == "Log.entryAdded" and params.get("entry", {}).get("level") in ("error", "warning"):
                found.append(f"log: {params['entry'].get('text')} {params['entry'].get('url', '')}")
        return found

    def screenshot(self, path: Path) -> None:
        data = self.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)["data"]
        path.write_bytes(base64.b64decode(data))


@contextlib.contextmanager
def chromium(profile: Path, width: int = 1280, height: int = 1400) -> Iterator[Page]:
    binary = chromium_binary()
    assert binary is not None
    process = subprocess.Popen(
        [binary, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-extensions",
         "--remote-debugging-port=0", "--remote-debugging-address=127.0.0.1", f"--user-data-dir={profile}",
         f"--window-size={width},{height}", "--hide-scrollbars", "about:blank"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + 60
        while not (port_file.is_file() and port_file.read_text().count("\n") >= 1):
            assert process.poll() is None, "chromium exited during start-up"
            assert time.monotonic() < deadline, "chromium did not open its DevTools port"
            time.sleep(0.05)  # polling a file chromium writes, with a deadline
        port = int(port_file.read_text().splitlines()[0])
        targets = httpx.get(f"http://127.0.0.1:{port}/json/list", timeout=10).json()
        page = Page(next(t["webSocketDebuggerUrl"] for t in targets if t["type"] == "page"))
        try:
            for domain in ("Runtime", "Log", "Page", "Network"):
                page.call(f"{domain}.enable")
            yield page
        finally:
            page.ws.close()
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
