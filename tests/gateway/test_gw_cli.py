"""The gateway's CLI commands as subprocesses: keys, gateway (start, serve, graceful
SIGINT with every row flushed), serve failing clearly when the engine dies."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tomllib

import httpx
from gw_fakes import FakeUpstream, rows, serve_in_thread, wait_healthy
from support.net import free_port

from gateway.config.config_file import parse_config
from gateway.policy.api_key import hash_key
from gateway.stats.database import default_db_url

CLI = [sys.executable, "-m", "gateway.cli"]


def test_keys_create_prints_once_and_writes_the_config(tmp_path):
    config = tmp_path / "gateway.toml"
    done = subprocess.run([*CLI, "keys", "create", "acme", "--config", str(config)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    key = done.stdout.split("store it now): ")[1].split()[0]
    parsed = parse_config(tomllib.loads(config.read_text()))
    assert parsed.key_hashes == {hash_key(key): "acme"}
    assert key not in config.read_text()
    plain = subprocess.run([*CLI, "keys", "create", "beta"], capture_output=True, text=True, timeout=60)
    assert "[tenants.beta]" in plain.stdout and "sha256:" in plain.stdout
    bad = subprocess.run([*CLI, "keys", "create", "bad name!"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2


def test_gateway_command_usage_errors(tmp_path):
    no_upstream = subprocess.run([*CLI, "gateway", "--data-dir", str(tmp_path)], capture_output=True, text=True,
                                 timeout=60)
    assert no_upstream.returncode == 2 and "no upstream" in no_upstream.stderr
    bad = tmp_path / "bad.toml"
    bad.write_text("[tenants.x]\nisolation = 'nope'\n")
    bad_config = subprocess.run([*CLI, "gateway", "--upstream", "http://127.0.0.1:1", "--config", str(bad)],
                                capture_output=True, text=True, timeout=60)
    assert bad_config.returncode == 2 and "isolation" in bad_config.stderr


def test_gateway_process_serves_and_flushes_every_row_on_sigint(tmp_path):
    upstream = FakeUpstream()
    port = free_port()
    with serve_in_thread(upstream.app) as upstream_url:
        process = subprocess.Popen(
            [*CLI, "gateway", "--upstream", upstream_url + "/v1", "--data-dir", str(tmp_path), "--port", str(port)],
            stderr=subprocess.PIPE, text=True, env={**os.environ, "PREFIXGATE_SECRET": ""},
        )
        try:
            url = f"http://127.0.0.1:{port}"
            wait_healthy(url, process, name="gateway")
            with httpx.Client(base_url=url, headers={"authorization": "Bearer me"}) as client:
                for i in range(25):
                    body = {"model": "fake-model", "messages": [{"role": "user", "content": f"q{i}"}]}
                    assert client.post("/v1/chat/completions", json=body).status_code == 200
            process.send_signal(signal.SIGINT)
            _, stderr = process.communicate(timeout=60)
        finally:
            if process.poll() is None:
                process.kill()
    assert process.returncode == 0, stderr
    assert "OPEN MODE" in stderr
    assert (tmp_path / "secret").exists()
    logged = rows(default_db_url(tmp_path))
    assert len(logged) == 25 and {r.status for r in logged} == {200}
    assert {r.upstream for r in logged} == {upstream_url}


def test_serve_fails_clearly_when_the_engine_exits(tmp_path):
    done = subprocess.run(
        [*CLI, "serve", "--data-dir", str(tmp_path), "--port", str(free_port()), "--engine-port", str(free_port()),
         "--engine-arg=--model=/nonexistent/model.gguf", "--engine-timeout", "300"],
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 1
    assert "engine exited with status" in done.stdout
