"""ReplicaSpec and RoutingOptions: which engine replicas the gateway fronts and how it routes.

Sources (the command line wins over the config file):

* ``--upstream URL[,events=ZMQ_ENDPOINT][,replay=ZMQ_ENDPOINT][,topic=TOPIC][,name=NAME]``,
  repeatable; or ``[[upstreams]]`` tables in the config with the keys ``url``,
  ``name``, ``kv_events``, ``kv_events_replay``, ``kv_events_topic``;
* ``[routing]`` in the config, or ``--tokenizer DIR``, ``--block-size N``,
  ``--load-cost-tokens N``, ``--health-interval S``.

Invariants: names are unique (default ``r0``, ``r1``... in order), URLs are
normalized like the single ``--upstream``; a bad value is a ``ValueError``
naming it.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.contract.limits import BLOCK_SIZE

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
ZMQ_ENDPOINT = re.compile(r"^(tcp|ipc|inproc)://\S+$")
DEFAULT_LOAD_COST_TOKENS = 32
DEFAULT_MISS_WEIGHT = 2.0
DEFAULT_HEALTH_INTERVAL_S = 2.0


@dataclass(frozen=True)
class ReplicaSpec:
    url: str
    name: str
    kv_events: str | None = None
    kv_events_replay: str | None = None
    kv_events_topic: str = ""


@dataclass(frozen=True)
class RoutingOptions:
    """``tokenizer``: a model directory (tokenizer.json + chat template) for block keys;
    None: the bundled model's when it has been converted, else routing by load only."""

    tokenizer: Path | None = None
    block_size: int = BLOCK_SIZE
    load_cost_tokens: int = DEFAULT_LOAD_COST_TOKENS
    miss_weight: float = DEFAULT_MISS_WEIGHT
    health_interval_s: float = DEFAULT_HEALTH_INTERVAL_S


def _endpoint(value: Any, where: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not ZMQ_ENDPOINT.match(value):
        raise ValueError(f"{where}: expected a ZMQ endpoint like tcp://127.0.0.1:5557, got {value!r}")
    return value


def normalize_base_url(url: str) -> str:
    """``http://host:port`` from a URL that may end in ``/`` or ``/v1``."""
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"upstream URL must start with http:// or https://, got {url!r}")
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def make_spec(url: Any, name: Any, index: int, events: Any = None, replay: Any = None, topic: Any = "",
              where: str = "upstream") -> ReplicaSpec:
    if not isinstance(url, str):
        raise ValueError(f"{where}.url: expected a URL string, got {url!r}")
    name = f"r{index}" if name is None else name
    if not isinstance(name, str) or not NAME.match(name):
        raise ValueError(f"{where}.name: invalid replica name {name!r}")
    if not isinstance(topic, str):
        raise ValueError(f"{where}.kv_events_topic: expected a string, got {topic!r}")
    return ReplicaSpec(normalize_base_url(url), name, _endpoint(events, f"{where}.kv_events"),
                       _endpoint(replay, f"{where}.kv_events_replay"), topic)


def parse_upstream_arg(value: str, index: int) -> ReplicaSpec:
    """One ``--upstream`` value: ``URL[,events=...][,replay=...][,topic=...][,name=...]``."""
    url, *options = value.split(",")
    fields: dict[str, str] = {}
    for option in options:
        key, sep, item = option.partition("=")
        if not sep or key not in ("events", "replay", "topic", "name") or key in fields:
            raise ValueError(f"--upstream {value!r}: unknown or repeated option {option!r} "
                             "(expected events=, replay=, topic=, name=)")
        fields[key] = item
    return make_spec(url, fields.get("name"), index, fields.get("events"), fields.get("replay"),
                     fields.get("topic", ""), where=f"--upstream {value!r}")


def check_unique(specs: Sequence[ReplicaSpec]) -> tuple[ReplicaSpec, ...]:
    names = [s.name for s in specs]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"replica names must be unique, repeated: {duplicates}")
    return tuple(specs)


def parse_upstreams_table(value: Any) -> tuple[ReplicaSpec, ...]:
    """The ``[[upstreams]]`` array of tables of the config file."""
    if not isinstance(value, list) or not all(isinstance(t, Mapping) for t in value):
        raise ValueError(f"upstreams: expected an array of tables ([[upstreams]]), got {value!r}")
    specs = []
    known = {"url", "name", "kv_events", "kv_events_replay", "kv_events_topic"}
    for i, table in enumerate(value):
        unknown = set(table) - known
        if unknown:
            raise ValueError(f"upstreams[{i}]: unknown field(s) {sorted(unknown)!r}")
        specs.append(make_spec(table.get("url"), table.get("name"), i, table.get("kv_events"),
                               table.get("kv_events_replay"), table.get("kv_events_topic", ""),
                               where=f"upstreams[{i}]"))
    return check_unique(specs)


def _positive(table: Mapping[str, Any], key: str, default: Any, kind: type) -> Any:
    value = table.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0 or (
            kind is int and not isinstance(value, int)):
        raise ValueError(f"routing.{key}: expected a positive {kind.__name__}, got {value!r}")
    return kind(value)


def parse_routing_table(value: Any) -> RoutingOptions:
    """The ``[routing]`` table of the config file."""
    if not isinstance(value, Mapping):
        raise ValueError(f"routing: expected a table, got {value!r}")
    unknown = set(value) - {"tokenizer", "block_size", "load_cost_tokens", "miss_weight", "health_interval_s"}
    if unknown:
        raise ValueError(f"routing: unknown field(s) {sorted(unknown)!r}")
    tokenizer = value.get("tokenizer")
    if tokenizer is not None and not isinstance(tokenizer, str):
        raise ValueError(f"routing.tokenizer: expected a directory path, got {tokenizer!r}")
    return RoutingOptions(
        tokenizer=Path(tokenizer) if tokenizer else None,
        block_size=_positive(value, "block_size", 16, int),
        load_cost_tokens=_positive(value, "load_cost_tokens", DEFAULT_LOAD_COST_TOKENS, int),
        miss_weight=_positive(value, "miss_weight", DEFAULT_MISS_WEIGHT, float),
        health_interval_s=_positive(value, "health_interval_s", DEFAULT_HEALTH_INTERVAL_S, float),
    )


def local_replicas(count: int, engine_port: int, events_dir: Path) -> list[tuple[list[str], ReplicaSpec]]:
    """``prefixgate serve --replicas N``: per replica, its extra engine arguments and its spec.

    Replica ``i`` listens on ``engine_port + i`` and publishes KV events on
    ``ipc://events_dir/rI-events.sock`` (replay: ``rI-replay.sock``). Events carry the
    token ids of every tenant's cached prompts, so they never go on a TCP port that
    any local process could subscribe to: ``events_dir`` is a directory only the
    owner can enter (``serve`` makes it with ``tempfile.mkdtemp``, mode 0700).
    """
    import json

    if count < 1:
        raise ValueError(f"--replicas must be at least 1, got {count}")
    out: list[tuple[list[str], ReplicaSpec]] = []
    for i in range(count):
        url = f"http://127.0.0.1:{engine_port + i}"
        if count == 1:
            out.append(([], make_spec(url, None, i)))
            continue
        events = f"ipc://{events_dir / f'r{i}-events.sock'}"
        replay = f"ipc://{events_dir / f'r{i}-replay.sock'}"
        config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": events,
                  "replay_endpoint": replay, "topic": "kv-events"}
        out.append((["--kv-events-config", json.dumps(config)], make_spec(url, None, i, events, replay, "kv-events")))
    return out


def add_routing_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tokenizer", type=Path, default=None, metavar="DIR",
                        help="model directory whose tokenizer.json and chat template the replicas use "
                             "(default: the bundled model's, when converted)")
    parser.add_argument("--block-size", type=int, default=None, help="the replicas' KV block size (default 16)")
    parser.add_argument("--load-cost-tokens", type=int, default=None,
                        help=f"routing cost of one in-flight request, in prompt tokens (default {DEFAULT_LOAD_COST_TOKENS})")
    parser.add_argument("--miss-weight", type=float, default=None,
                        help=f"weight of the tokens a request must prefill against queued work "
                        f"(default {DEFAULT_MISS_WEIGHT:g}; see docs/routing.md)")
    parser.add_argument("--health-interval", type=float, default=None, metavar="S",
                        help=f"seconds between replica health checks (default {DEFAULT_HEALTH_INTERVAL_S:g})")


def routing_from_args(args: argparse.Namespace, base: RoutingOptions) -> RoutingOptions:
    """``base`` (from the config) overridden by the command line; ValueError for bad values."""
    numbers: dict[str, Any] = {
        "block_size": getattr(args, "block_size", None) or base.block_size,
        "load_cost_tokens": getattr(args, "load_cost_tokens", None) or base.load_cost_tokens,
        "miss_weight": getattr(args, "miss_weight", None) or base.miss_weight,
        "health_interval_s": getattr(args, "health_interval", None) or base.health_interval_s,
    }
    for key, value in numbers.items():
        if value <= 0:
            raise ValueError(f"--{key.replace('_', '-')}: expected a positive number, got {value!r}")
    return RoutingOptions(tokenizer=getattr(args, "tokenizer", None) or base.tokenizer, **numbers)
