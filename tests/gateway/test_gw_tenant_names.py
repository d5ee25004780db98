"""Open-mode tenant ids (128 bits), the short labels reports show, ``prefixgate keys label``,
and the warnings about a secret file that others can read (``keys create`` and the gateway)."""

from __future__ import annotations

import argparse
import hashlib
import io
import logging
import os

import pytest

from gateway.cli import main
from gateway.commands import gateway as gateway_command
from gateway.config.config_file import NAME_PATTERN, GatewayConfig
from gateway.policy.authenticator import Authenticator
from gateway.policy.tenant_names import LABEL_HEX, label_of_key, labels, open_tenant_id
from gateway.server.launcher import build_settings


def test_open_mode_tenant_ids_carry_128_bits_of_the_key_hash():
    tenant = Authenticator(GatewayConfig(), open_mode=True).tenant_for("Bearer sk-mine")
    digest = hashlib.sha256(b"sk-mine").hexdigest()
    assert tenant.name == open_tenant_id("sk-mine") == "open-" + digest[:32]
    assert len(tenant.name) - len("open-") == 128 // 4 and NAME_PATTERN.match(tenant.name)
    assert "sk-mine" not in tenant.name


def test_labels_are_short_unique_and_merge_an_older_id_of_the_same_key():
    ids = [open_tenant_id(f"key-{i}") for i in range(300)]
    named = labels([*ids, "alpha", "(unauthenticated)"])
    assert named["alpha"] == "alpha" and named["(unauthenticated)"] == "(unauthenticated)"
    assert len({named[i] for i in ids}) == 300  # one label per key
    assert all(named[i] == label_of_key(f"key-{n}") for n, i in enumerate(ids))  # no clash among these 300
    # Two different keys whose ids share the first 8 digits get longer labels, unique ones.
    twins = ["open-abcdef01" + "0" * 24, "open-abcdef01" + "1" * 24]
    legacy = "open-abcdef01" + "1111"  # 12 digits, as written before ids grew
    named = labels([*twins, legacy])
    assert named[twins[0]] == "open-abcdef010" and named[twins[1]] == "open-abcdef011" == named[legacy]
    assert len(labels([open_tenant_id("x"), open_tenant_id("x")[:17]])) == 2  # both named, one label
    assert len(set(labels([open_tenant_id("x"), open_tenant_id("x")[:17]]).values())) == 1
    assert all(len(label) >= len("open-") + LABEL_HEX for label in labels(ids).values())


def test_keys_label_reads_the_key_from_stdin(monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO("sk-mine\n"))
    assert main(["keys", "label"]) == 0
    out = capsys.readouterr().out
    assert f"label: {label_of_key('sk-mine')}" in out and f"tenant id: {open_tenant_id('sk-mine')}" in out
    assert "sk-mine" not in out
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    assert main(["keys", "label"]) == 2
    assert "no key on stdin" in capsys.readouterr().err


def test_keys_create_prints_the_label_its_key_gets_in_open_mode(capsys):
    assert main(["keys", "create", "acme"]) == 0
    out = capsys.readouterr().out
    key = out.split("store it now): ", 1)[1].split()[0]
    assert f"reports show its tenant as {label_of_key(key)}" in out


@pytest.mark.parametrize(("initial", "warned"), [(0o600, None), (0o640, "its group"), (0o644, "everyone")])
def test_keys_create_warns_about_a_readable_config_holding_the_secret(tmp_path, capsys, initial, warned):
    config = tmp_path / "gateway.toml"
    config.write_text('[server]\nsecret = "0123456789abcdef0123456789abcdef"\n')
    os.chmod(config, initial)
    assert main(["keys", "create", "acme", "--config", str(config)]) == 0
    err = capsys.readouterr().err
    if warned is None:
        assert err == ""
    else:
        assert f"readable by {warned}" in err and f"chmod 600 {config}" in err
    without_secret = tmp_path / "plain.toml"
    without_secret.write_text("[tenants.beta]\n")
    os.chmod(without_secret, 0o644)
    assert main(["keys", "create", "acme", "--config", str(without_secret)]) == 0
    assert capsys.readouterr().err == ""  # nothing secret in it


def _args(tmp_path, config) -> argparse.Namespace:
    """``prefixgate gateway --config CONFIG --data-dir DATA`` as its own parser reads it."""
    parser = argparse.ArgumentParser()
    gateway_command.add_parser(parser.add_subparsers())
    return parser.parse_args(["gateway", "--config", str(config), "--data-dir", str(tmp_path / "data")])


@pytest.mark.parametrize("where", ["config", "data_dir"])
def test_the_gateway_warns_about_a_readable_secret_file(tmp_path, monkeypatch, caplog, where):
    monkeypatch.delenv("PREFIXGATE_SECRET", raising=False)
    config = tmp_path / "gateway.toml"
    config.write_text('[server]\nupstream = "http://127.0.0.1:9"\n'
                      + ('secret = "0123456789abcdef0123456789abcdef"\n' if where == "config" else ""))
    os.chmod(config, 0o600 if where == "config" else 0o644)  # 0644 is fine without a secret in it
    settings = build_settings(_args(tmp_path, config), None)
    assert settings.startup_warnings == ()  # (data_dir/secret is created 0600)
    exposed = config if where == "config" else tmp_path / "data" / "secret"
    os.chmod(exposed, 0o644)
    settings = build_settings(_args(tmp_path, config), None)
    assert len(settings.startup_warnings) == 1 and str(exposed) in settings.startup_warnings[0]
    assert "readable by everyone" in settings.startup_warnings[0]
    from gateway.server import launcher

    def stop(*args, **kwargs):
        raise SystemExit(0)

    monkeypatch.setattr("gateway.server.app.create_app", stop)  # after the start-up lines, before serving
    with caplog.at_level(logging.WARNING, logger="gateway.server.launcher"), pytest.raises(SystemExit):
        launcher.run_gateway(settings, "127.0.0.1", 0)
    assert [r.getMessage() for r in caplog.records if "server secret" in r.getMessage()] == [
        settings.startup_warnings[0]]
