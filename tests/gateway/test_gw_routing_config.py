"""Replica configuration ([[upstreams]], [routing], repeated --upstream), the replica
columns' migration, and the per-replica stats (library and `prefixgate stats --by replica`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import inspect

from gateway.config.config_file import parse_config
from gateway.config.replica_spec import local_replicas, parse_upstream_arg
from gateway.request_record import RequestRecord
from gateway.stats import database
from gateway.stats.report import per_replica
from gateway.stats.writer import StatsWriter

CLI = [sys.executable, "-m", "gateway.cli"]


def test_upstreams_table_and_routing_table() -> None:
    config = parse_config({
        "upstreams": [
            {"url": "http://10.0.0.1:8000/v1", "kv_events": "tcp://10.0.0.1:5557",
             "kv_events_replay": "tcp://10.0.0.1:5558", "kv_events_topic": "kv-events"},
            {"url": "http://10.0.0.2:8000", "name": "gpu-2"},
        ],
        "routing": {"tokenizer": "/models/qwen", "block_size": 32, "load_cost_tokens": 512},
    })
    first, second = config.upstreams
    assert (first.name, first.url, first.kv_events, first.kv_events_replay) == (
        "r0", "http://10.0.0.1:8000", "tcp://10.0.0.1:5557", "tcp://10.0.0.1:5558")
    assert (second.name, second.kv_events) == ("gpu-2", None)
    assert config.routing.block_size == 32 and config.routing.load_cost_tokens == 512
    assert str(config.routing.tokenizer) == "/models/qwen"


@pytest.mark.parametrize("data, message", [
    ({"upstreams": {"url": "http://x"}}, "array of tables"),
    ({"upstreams": [{"url": "ftp://x"}]}, "http://"),
    ({"upstreams": [{"url": "http://x", "kv_events": "http://y"}]}, "ZMQ endpoint"),
    ({"upstreams": [{"url": "http://x", "colour": "red"}]}, "unknown field"),
    ({"upstreams": [{"url": "http://x", "name": "a"}, {"url": "http://y", "name": "a"}]}, "unique"),
    ({"routing": {"block_size": 0}}, "block_size"),
    ({"routing": {"block_size": 1.5}}, "block_size"),
    ({"routing": {"speed": 1}}, "unknown field"),
])
def test_bad_replica_config_is_a_value_error(data, message) -> None:
    with pytest.raises(ValueError, match=message):
        parse_config(data)


def test_upstream_argument_and_local_replicas() -> None:
    spec = parse_upstream_arg("http://127.0.0.1:8002,events=tcp://127.0.0.1:5559,replay=tcp://127.0.0.1:5560", 1)
    assert (spec.name, spec.url, spec.kv_events, spec.kv_events_replay) == (
        "r1", "http://127.0.0.1:8002", "tcp://127.0.0.1:5559", "tcp://127.0.0.1:5560")
    with pytest.raises(ValueError, match="unknown or repeated option"):
        parse_upstream_arg("http://x,colour=red", 0)
    private = Path("/run/private-dir")
    (args0, r0), (args1, r1) = local_replicas(2, 8001, private)
    # events name every tenant's tokens: owner-only Unix sockets, never a TCP port
    assert r1.url == "http://127.0.0.1:8002" and r1.kv_events == "ipc:///run/private-dir/r1-events.sock"
    assert json.loads(args1[1])["replay_endpoint"] == "ipc:///run/private-dir/r1-replay.sock"
    assert args0[0] == "--kv-events-config"
    assert local_replicas(1, 8001, private) == [([], r0.__class__("http://127.0.0.1:8001", "r0"))]


def test_gateway_command_rejects_a_bad_upstream_with_exit_2(tmp_path) -> None:
    done = subprocess.run([*CLI, "gateway", "--upstream", "http://127.0.0.1:1,events=nope", "--data-dir",
                           str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "ZMQ endpoint" in done.stderr and "Traceback" not in done.stderr


def test_replica_columns_migrate_up_down_up(tmp_path) -> None:
    url = database.default_db_url(tmp_path)
    database.upgrade(url)

    def columns() -> set[str]:
        engine = database.create_db_engine(url)
        try:
            return {c["name"] for c in inspect(engine).get_columns("request_log")}
        finally:
            engine.dispose()

    assert {"replica", "predicted_cached_tokens", "cached_tokens"} <= columns()
    database.downgrade(url, "0001_request_log")
    assert "replica" not in columns() and "predicted_cached_tokens" not in columns() and "cached_tokens" in columns()
    database.upgrade(url)
    assert {"replica", "predicted_cached_tokens"} <= columns()


def test_per_replica_stats_library_and_cli(tmp_path) -> None:
    url = database.default_db_url(tmp_path)
    database.upgrade(url)
    engine = database.create_db_engine(url)
    writer = StatsWriter(engine, batch_size=4)
    for replica, predicted, cached in [("r0", 32, 32), ("r0", 0, 16), ("r1", 48, 48), ("r1", None, 0)]:
        record = RequestRecord(endpoint="chat.completions", upstream="http://x", tenant="t", model="m")
        record.replica, record.predicted_cached_tokens = replica, predicted
        record.take_usage({"prompt_tokens": 64, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": cached}})
        record.finish(200)
        writer.submit(record)
    writer.close()
    groups = per_replica(engine)
    engine.dispose()
    assert groups["r0"].compared == 2 and groups["r0"].exact == 1 and groups["r0"].predicted_tokens == 32
    assert groups["r1"].compared == 1 and groups["r1"].exact == 1 and groups["r1"].cached_tokens == 48
    done = subprocess.run([*CLI, "stats", "--by", "replica", "--data-dir", str(tmp_path), "--format", "json"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    by_name = {row["replica"]: row for row in json.loads(done.stdout)}
    assert by_name["r0"]["exact_predictions"] == 1 and by_name["r0"]["predicted_requests"] == 2
    text = subprocess.run([*CLI, "stats", "--by", "replica", "--data-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=120).stdout
    assert "predicted" in text and "1/2" in text and "1/1" in text
