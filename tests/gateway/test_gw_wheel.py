"""The installed product: build the wheel, install it into a fresh venv (no source
tree on its path) and use it the way a new user does -- ``prefixgate db upgrade``,
``prefixgate gateway --help`` and one proxied request through ``prefixgate gateway``.

The fresh venv resolves the wheel's dependencies with pip like any user's install
(so a dependency missing from pyproject.toml fails here); the engine extra is left
out, which also proves the gateway never needs torch.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import venv
from pathlib import Path

import httpx
import pytest
from gw_fakes import FakeUpstream, rows, serve_in_thread, wait_healthy
from support.net import free_port

from gateway.stats.database import default_db_url

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv with the freshly built wheel installed; returns its bin directory."""
    base = tmp_path_factory.mktemp("wheel")
    # Build from a clean copy: a stale build/ directory in the checkout could otherwise
    # smuggle files into the wheel that package-data no longer names.
    source = base / "source"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        source.mkdir(exist_ok=True)
        shutil.copy2(ROOT / name, source / name)
    for package in ("engine", "linter", "gateway", "migrations"):
        shutil.copytree(ROOT / package, source / package, ignore=ignore)
    pip = [sys.executable, "-m", "pip"]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # nothing of the checkout is installed already
    built = subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(base / "dist"), str(source)],
        capture_output=True, text=True, timeout=300, env=env,
    )
    assert built.returncode == 0, built.stderr
    (wheel,) = (base / "dist").glob("prefixgate-*.whl")
    venv.create(base / "venv", with_pip=False)
    python = base / "venv" / "bin" / "python"
    done = subprocess.run(
        [*pip, "--python", str(python), "install", "-q", str(wheel)],
        capture_output=True, text=True, timeout=600, env=env,
    )
    assert done.returncode == 0, done.stderr
    return python.parent


def head_revision() -> str:
    """The newest revision of the checkout's migrations (the wheel must carry them all)."""
    from alembic.script import ScriptDirectory

    from gateway.stats.database import alembic_config

    head = ScriptDirectory.from_config(alembic_config("sqlite://")).get_current_head()
    assert head is not None
    return str(head)


def run(bindir: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PREFIXGATE_MIGRATIONS")}
    return subprocess.run([str(bindir / "prefixgate"), *args], capture_output=True, text=True,
                          timeout=120, cwd=cwd, env=env)


def test_the_wheel_is_imported_from_site_packages_without_torch(installed, tmp_path):
    code = "import sys, gateway.server.app; print(gateway.server.app.__file__); print('torch' in sys.modules)"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the wheel, not the checkout
    done = subprocess.run([str(installed / "python"), "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr
    where, torch_loaded = done.stdout.split()
    assert "site-packages" in where and not where.startswith(str(ROOT))
    assert torch_loaded == "False"


def test_db_upgrade_and_gateway_help_from_the_wheel(installed, tmp_path):
    upgraded = run(installed, "db", "upgrade", "--data-dir", str(tmp_path / "data"), cwd=tmp_path)
    assert upgraded.returncode == 0, upgraded.stderr
    assert upgraded.stdout.strip().endswith(f"revision {head_revision()}")
    helped = run(installed, "gateway", "--help", cwd=tmp_path)
    assert helped.returncode == 0 and "--upstream-kind" in helped.stdout and "example" in helped.stdout


def test_one_proxied_request_through_the_installed_gateway(installed, tmp_path):
    upstream = FakeUpstream()
    port = free_port()
    data = tmp_path / "data"
    with serve_in_thread(upstream.app) as upstream_url:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        process = subprocess.Popen(
            [str(installed / "prefixgate"), "gateway", "--upstream", upstream_url, "--data-dir", str(data),
             "--port", str(port)],
            stderr=subprocess.PIPE, text=True, cwd=tmp_path, env=env,
        )
        try:
            url = f"http://127.0.0.1:{port}"
            wait_healthy(url, process, name="installed gateway")
            body = {"model": "fake-model", "messages": [{"role": "user", "content": "hello"}]}
            answer = httpx.post(url + "/v1/chat/completions", json=body, headers={"authorization": "Bearer me"})
            assert answer.status_code == 200 and answer.json()["choices"][0]["message"]["content"] == "hi!"
            page = httpx.get(url + "/dashboard")  # open mode: the page is package data of the wheel
            assert page.status_code == 200 and "<title>prefixgate dashboard</title>" in page.text
            process.send_signal(signal.SIGINT)
            _, stderr = process.communicate(timeout=60)
        finally:
            if process.poll() is None:
                process.kill()
    assert process.returncode == 0, stderr
    assert "cache_salt" in upstream.bodies[0]
    assert [row.status for row in rows(default_db_url(data))] == [200]
