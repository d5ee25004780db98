"""``--upstream-kind llamacpp``: llama.cpp's server ignores ``cache_salt``, so the gateway
sends none, refuses to start in front of it when a tenant needs isolation (exit 2, one
line) unless ``--allow-shared-cache`` (then it says so in its log), and maps the
server's ``timings.cache_n`` to OpenAI's ``cached_tokens``.

No llama.cpp server runs on this machine: the upstream here is an ``httpx.MockTransport``
answering in the shape llama.cpp's server uses (``usage`` plus ``timings``)."""

from __future__ import annotations

import asyncio
import dataclasses
import signal
import subprocess
import sys
from typing import Any

import httpx
import orjson
import pytest
from gw_fakes import gateway_client, make_settings, rows
from support.net import free_port

from gateway.config.config_file import Tenant
from gateway.policy.api_key import hash_key
from gateway.upstream.kinds import check_isolation, openai_usage, scoped_body

CLI = [sys.executable, "-m", "gateway.cli"]
KEY = "pg-acme-key-0123"


def config_file(tmp_path, isolation: str) -> str:
    path = tmp_path / "gateway.toml"
    path.write_text(f'[tenants.acme]\nkeys = ["{hash_key(KEY)}"]\nisolation = "{isolation}"\n')
    return str(path)


@pytest.mark.parametrize(("kind", "tenants", "open_mode", "allow", "problem"), [
    ("llamacpp", [Tenant("acme")], False, False, "acme"),
    ("llamacpp", [Tenant("acme", isolation="group:team")], False, False, "acme"),
    ("llamacpp", [], True, False, "open-mode"),
    ("llamacpp", [Tenant("acme")], False, True, None),
    ("llamacpp", [Tenant("acme", isolation="shared")], False, False, None),
    ("vllm", [Tenant("acme")], False, False, None),
    ("openai", [], True, False, None),
])
def test_isolation_check(kind, tenants, open_mode, allow, problem) -> None:
    found = check_isolation(kind, tenants, open_mode, allow)
    assert (found is None) == (problem is None)
    if problem is not None:
        assert problem in found and "--allow-shared-cache" in found and "\n" not in found


def test_no_salt_goes_to_llamacpp_and_its_cache_fields_map_to_openai_usage() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert "cache_salt" not in scoped_body("llamacpp", body, b"s" * 32, "tenant:acme", "client")
    answer = {"usage": {"prompt_tokens": 50, "completion_tokens": 2, "total_tokens": 52},
              "timings": {"cache_n": 40, "prompt_n": 10}}
    assert openai_usage("llamacpp", answer)["prompt_tokens_details"] == {"cached_tokens": 40}
    assert openai_usage("vllm", answer) is None
    reported = {**answer, "usage": {**answer["usage"], "prompt_tokens_details": {"cached_tokens": 32}}}
    assert openai_usage("llamacpp", reported) is None  # already OpenAI-shaped: kept
    assert openai_usage("llamacpp", {**answer, "timings": {"cache_n": -1}}) is None


def llamacpp_answer(request: httpx.Request) -> httpx.Response:
    body = orjson.loads(request.content)
    assert "cache_salt" not in body
    return httpx.Response(200, json={
        "id": "chatcmpl-1", "object": "chat.completion", "model": body["model"],
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 50, "completion_tokens": 1, "total_tokens": 51},
        "timings": {"cache_n": 48, "prompt_n": 2, "predicted_n": 1},
    })


def test_the_gateway_reports_llamacpp_cached_tokens_the_openai_way(tmp_path) -> None:
    settings = dataclasses.replace(make_settings(tmp_path, {"tenants": {"acme": {
        "keys": [hash_key(KEY)], "isolation": "shared"}}}), upstream_kind="llamacpp")

    async def go() -> dict[str, Any]:
        async with gateway_client(settings, httpx.MockTransport(llamacpp_answer)) as client:
            answer = await client.post("/v1/chat/completions", headers={"authorization": f"Bearer {KEY}"},
                                       json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
            assert answer.status_code == 200, answer.text
            return dict(answer.json())

    answer = asyncio.run(go())
    assert answer["usage"]["prompt_tokens_details"] == {"cached_tokens": 48}
    assert [row.cached_tokens for row in rows(settings.db_url)] == [48]


def test_an_isolated_tenant_in_front_of_llamacpp_exits_2_in_one_line(tmp_path) -> None:
    done = subprocess.run([*CLI, "gateway", "--upstream", "http://127.0.0.1:9", "--upstream-kind", "llamacpp",
                           "--config", config_file(tmp_path, "isolated"), "--data-dir", str(tmp_path),
                           "--port", str(free_port())], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot isolate" in lines[0] and "--allow-shared-cache" in lines[0], done.stderr
    assert "Traceback" not in done.stderr


def test_with_the_opt_in_it_starts_and_says_the_cache_is_shared(tmp_path) -> None:
    process = subprocess.Popen(
        [*CLI, "gateway", "--upstream", "http://127.0.0.1:9", "--upstream-kind", "llamacpp", "--allow-shared-cache",
         "--config", config_file(tmp_path, "isolated"), "--data-dir", str(tmp_path), "--port", str(free_port()),
         "--workers", "1"], stderr=subprocess.PIPE, text=True)
    assert process.stderr is not None
    announced = False
    try:
        for line in process.stderr:  # the announcement comes before uvicorn starts
            if "ALL TENANTS SHARE" in line:
                announced = True
            elif "Uvicorn running" in line or "Application startup complete" in line:
                assert announced, "started without announcing the shared cache"
                break  # started: stopped below once up, not halfway through its start-up
        else:
            assert announced, f"exited {process.wait()} without announcing the shared cache"
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.communicate(timeout=60)  # reads the rest of stderr: a full pipe never blocks its exit
        finally:
            if process.poll() is None:
                process.kill()
