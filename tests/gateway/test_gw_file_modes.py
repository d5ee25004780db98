"""Files holding secrets or stats are created 0600 and keep their mode when prefixgate rewrites them."""

from __future__ import annotations

import asyncio
import os
import stat
import subprocess
import sys
import time

import httpx
import pytest
from gw_fakes import gateway_client, make_settings, rows

from gateway.cli import main
from gateway.config.config_file import load_config
from gateway.stats.database import create_db_engine, default_db_url, upgrade


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.mark.parametrize("initial", [0o600, 0o640, 0o644])
def test_keys_create_keeps_the_config_mode(tmp_path, capsys, initial):
    config = tmp_path / "gateway.toml"
    config.write_text('[server]\nsecret = "0123456789abcdef0123456789abcdef"\n')
    os.chmod(config, initial)
    assert main(["keys", "create", "acme", "--config", str(config)]) == 0
    assert main(["keys", "create", "--admin", "--config", str(config)]) == 0
    assert mode(config) == initial
    loaded = load_config(config)
    assert "acme" in loaded.tenants and loaded.admin_key_hashes
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gateway.toml"]  # no temporary file left


def test_keys_create_makes_a_new_config_0600_whatever_the_umask(tmp_path):
    config = tmp_path / "new.toml"
    # A subprocess with a permissive umask: the file must still be owner-only.
    code = f"import os, sys; os.umask(0); from gateway.cli import main; sys.exit(main({['keys', 'create', 'acme', '--config', str(config)]!r}))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert mode(config) == 0o600


def test_stats_database_and_its_wal_and_shm_are_0600(tmp_path, fake_upstream):
    old_umask = os.umask(0o022)
    try:
        settings = make_settings(tmp_path)

        async def go():
            async with gateway_client(settings, httpx.ASGITransport(fake_upstream.app)) as gw:
                response = await gw.post("/v1/chat/completions", headers={"authorization": "Bearer k"},
                                         json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
                assert response.status_code == 200
                # While the app runs, the writer's connection holds the WAL and SHM files open.
                deadline = time.monotonic() + 30
                while not rows(settings.db_url):
                    assert time.monotonic() < deadline, "the row was never written"
                    await asyncio.sleep(0.02)
                database = settings.db_url.removeprefix("sqlite:///")
                return {suffix: mode(database + suffix) for suffix in ("", "-wal", "-shm")
                        if os.path.exists(database + suffix)}

        modes = asyncio.run(go())
    finally:
        os.umask(old_umask)
    assert set(modes) == {"", "-wal", "-shm"} and set(modes.values()) == {0o600}
    assert len(rows(settings.db_url)) == 1


def test_an_existing_database_keeps_its_mode(tmp_path):
    url = default_db_url(tmp_path / "data")
    upgrade(url)
    database = url.removeprefix("sqlite:///")
    assert mode(database) == 0o600 and mode(tmp_path / "data") == 0o700
    os.chmod(database, 0o640)
    upgrade(url)
    create_db_engine(url).dispose()
    assert mode(database) == 0o640
