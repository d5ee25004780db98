"""Server-side salts: scopes never collide, client salts only narrow; the secret file."""

from __future__ import annotations

import os
import stat
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.config.config_file import Tenant
from gateway.policy.salt import derive_cache_salt, load_or_create_secret

SECRET = b"s" * 32
names = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,10}", fullmatch=True)
salts = st.none() | st.text(min_size=1, max_size=20)


@settings(deadline=None)  # a loaded CI machine must not turn slowness into failures
@given(names, names, salts, salts)
def test_different_scopes_never_share_a_salt(a, b, salt_a, salt_b):
    if a == b:
        return
    for scope_a, scope_b in ((f"tenant:{a}", f"tenant:{b}"), (f"tenant:{a}", f"group:{a}"), (f"group:{a}", f"group:{b}")):
        assert derive_cache_salt(SECRET, scope_a, salt_a) != derive_cache_salt(SECRET, scope_b, salt_b)


@settings(deadline=None)
@given(names, st.text(min_size=1, max_size=20), st.text(min_size=1, max_size=20))
def test_client_salts_narrow_within_a_scope(name, salt_a, salt_b):
    scope = f"tenant:{name}"
    base = derive_cache_salt(SECRET, scope, None)
    assert derive_cache_salt(SECRET, scope, salt_a) != base
    assert (derive_cache_salt(SECRET, scope, salt_a) == derive_cache_salt(SECRET, scope, salt_b)) == (salt_a == salt_b)


def test_salt_shape_and_secret_dependence():
    salt = derive_cache_salt(SECRET, "tenant:a", "x")
    assert salt is not None and len(salt) == 64 and int(salt, 16) >= 0
    assert derive_cache_salt(b"t" * 32, "tenant:a", "x") != salt
    assert derive_cache_salt(SECRET, None, None) is None  # shared without client salt
    assert derive_cache_salt(SECRET, None, "x") not in (None, derive_cache_salt(SECRET, "tenant:a", "x"))


def test_tenant_scopes():
    assert Tenant("acme").scope == "tenant:acme"
    assert Tenant("acme", isolation="group:lab").scope == "group:lab"
    assert Tenant("acme", isolation="shared").scope is None


def test_secret_file_is_created_0600_and_reused(tmp_path, monkeypatch):
    monkeypatch.delenv("PREFIXGATE_SECRET", raising=False)
    first = load_or_create_secret(tmp_path / "data")
    path = tmp_path / "data" / "secret"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert load_or_create_secret(tmp_path / "data") == first
    assert len(first) >= 32
    assert load_or_create_secret(tmp_path / "other") != first
    assert load_or_create_secret(tmp_path / "data", "configured-secret-value") == b"configured-secret-value"
    monkeypatch.setenv("PREFIXGATE_SECRET", "from-the-environment")
    assert load_or_create_secret(tmp_path / "data") == b"from-the-environment"


def test_concurrent_first_starts_agree(tmp_path, monkeypatch):
    monkeypatch.delenv("PREFIXGATE_SECRET", raising=False)
    results = []
    threads = [threading.Thread(target=lambda: results.append(load_or_create_secret(tmp_path))) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(set(results)) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["secret"]


def test_truncated_secret_is_an_error(tmp_path, monkeypatch):
    monkeypatch.delenv("PREFIXGATE_SECRET", raising=False)
    (tmp_path / "secret").write_text("short")
    with pytest.raises(ValueError, match="truncated"):
        load_or_create_secret(tmp_path)
