"""Config parsing, authentication and the key-writing config editor."""

from __future__ import annotations

import tomllib

import pytest

from gateway.config.config_file import (
    CanonicalizeSwitches,
    GatewayConfig,
    load_config,
    parse_config,
)
from gateway.config.editor import add_key_hash
from gateway.errors import Forbidden, Unauthorized
from gateway.policy.api_key import generate_key, hash_key, key_matches
from gateway.policy.authenticator import Authenticator

EXAMPLE = f"""
[server]
admin_keys = ["{hash_key('admin')}"]
upstream = "http://127.0.0.1:8001"
max_body_bytes = 1048576

[tenants.acme]
keys = ["{hash_key('acme-key')}"]
isolation = "group:research"
reject_on = ["ps101"]

[tenants.acme.canonicalize]
tools = false

[tenants.public]
keys = ["{hash_key('public-key')}"]
isolation = "shared"
canonicalize = false
"""


def test_example_config(tmp_path):
    path = tmp_path / "gateway.toml"
    path.write_text(EXAMPLE)
    config = load_config(path)
    acme = config.tenants["acme"]
    assert acme.scope == "group:research" and acme.reject_on == {"PS101"}
    assert acme.canonicalize == CanonicalizeSwitches(tools=False)
    assert config.tenants["public"].canonicalize == CanonicalizeSwitches(*(False,) * 7)
    assert config.max_body_bytes == 1048576 and config.upstream == "http://127.0.0.1:8001"
    auth = Authenticator(config, open_mode=False)
    assert auth.tenant_for("Bearer acme-key").name == "acme"
    assert auth.tenant_for("bearer public-key").name == "public"
    with pytest.raises(Unauthorized):
        auth.tenant_for("Bearer acme-key2")
    with pytest.raises(Unauthorized):
        auth.tenant_for(None)
    auth.require_admin("Bearer admin")
    with pytest.raises(Forbidden) as tenant_key:  # a valid key, but not an admin's
        auth.require_admin("Bearer acme-key")
    assert tenant_key.value.code == "admin_key_required" and tenant_key.value.status == 403
    with pytest.raises(Unauthorized):
        auth.require_admin("Bearer nobody")


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"tenants": {"a": {"isolation": "private"}}}, "isolation"),
        ({"tenants": {"a": {"isolation": "group:"}}}, "isolation"),
        ({"tenants": {"bad name": {}}}, "invalid tenant name"),
        ({"tenants": {"a": {"keys": ["plain-key"]}}}, "not a key hash"),
        ({"tenants": {"a": {"keys": [hash_key("k")]}, "b": {"keys": [hash_key("k")]}}}, "already belongs"),
        ({"tenants": {"a": {"canonicalize": {"tool": True}}}}, "unknown switch"),
        ({"tenants": {"a": {"reject_on": "PS101"}}}, "reject_on"),
        ({"tenants": {"a": {"colour": "red"}}}, "unknown field"),
        ({"server": {"secret": "short"}}, "secret"),
        ({"server": {"max_body_bytes": 0}}, "max_body_bytes"),
        ({"server": {"inflight_body_bytes": 0}}, "inflight_body_bytes"),
        ({"server": {"tenant_inflight_body_bytes": -5}}, "tenant_inflight_body_bytes"),
        ({"server": {"body_timeout_s": "60"}}, "body_timeout_s"),
        ({"server": {"body_idle_timeout_s": True}}, "body_idle_timeout_s"),
        ({"serverr": {}}, "unknown top-level"),
    ],
)
def test_bad_config_names_the_field(data, message):
    with pytest.raises(ValueError, match=message):
        parse_config(data)


def test_body_limits_come_from_the_server_table():
    from engine.contract.body_reader import BodyLimits

    config = parse_config({"server": {"max_body_bytes": 1000, "inflight_body_bytes": 5000,
                                      "tenant_inflight_body_bytes": 2000, "body_timeout_s": 30,
                                      "body_idle_timeout_s": 2.5}})
    assert config.body_limits() == BodyLimits(max_bytes=1000, inflight_bytes=5000, tenant_inflight_bytes=2000,
                                              timeout_s=30.0, idle_timeout_s=2.5)
    defaults = GatewayConfig().body_limits()
    assert (defaults.max_bytes, defaults.inflight_bytes, defaults.tenant_inflight_bytes) == (8 << 20, 128 << 20, 64 << 20)


def test_invalid_toml(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[server\n")
    with pytest.raises(ValueError, match="invalid TOML"):
        load_config(path)


def test_open_mode_and_keys():
    auth = Authenticator(GatewayConfig(), open_mode=True)
    assert auth.tenant_for(None).name == "anonymous"
    assert auth.tenant_for("Bearer x").name == auth.tenant_for("Bearer x").name != auth.tenant_for("Bearer y").name
    assert auth.tenant_for("Bearer x").scope.startswith("tenant:open-")
    with pytest.raises(Forbidden):
        auth.require_admin("Bearer x")
    key = generate_key()
    assert key.startswith("pg-") and len(key) > 40 and generate_key() != key
    assert key_matches(key, hash_key(key)) and not key_matches(key + "x", hash_key(key))


def test_config_editor_adds_keys_and_keeps_comments(tmp_path):
    path = tmp_path / "gateway.toml"
    path.write_text("# my gateway\n[tenants.acme]\nisolation = \"shared\"  # global reuse\n\n[server]\n")
    add_key_hash(path, "acme", hash_key("one"))
    add_key_hash(path, "acme", hash_key("two"))
    add_key_hash(path, "newco", hash_key("three"))
    add_key_hash(path, None, hash_key("admin"))
    text = path.read_text()
    assert "# my gateway" in text and "# global reuse" in text
    config = parse_config(tomllib.loads(text))
    assert config.key_hashes == {hash_key("one"): "acme", hash_key("two"): "acme", hash_key("three"): "newco"}
    assert config.tenants["acme"].isolation == "shared"
    assert config.admin_key_hashes == {hash_key("admin")}
    new = tmp_path / "new.toml"
    add_key_hash(new, "solo", hash_key("k"))
    assert parse_config(tomllib.loads(new.read_text())).key_hashes == {hash_key("k"): "solo"}
