"""``prefixgate serve --kv-offload-dir``: the flags each engine gets (one directory per replica)."""

from __future__ import annotations

import argparse
import os
import stat

import pytest

from gateway.commands.serve import _offload_args


def ns(**kw):
    base = {"kv_offload_dir": None, "kv_offload_size": None, "replicas": 1}
    return argparse.Namespace(**{**base, **kw})


def test_one_engine_gets_the_directory_and_the_size(tmp_path):
    d = str(tmp_path / "kv")
    assert _offload_args(ns(kv_offload_dir=d, kv_offload_size=2.5), 0) == [f"--kv-offload-dir={d}",
                                                                          "--kv-offload-size=2.5"]
    assert _offload_args(ns(), 0) == []


def test_replicas_get_a_private_directory_each(tmp_path):
    d = str(tmp_path / "kv")
    flags = [_offload_args(ns(kv_offload_dir=d, replicas=2), i) for i in range(2)]
    assert flags == [[f"--kv-offload-dir={d}/replica-0"], [f"--kv-offload-dir={d}/replica-1"]]
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700


def test_a_size_without_a_directory_is_a_usage_error():
    with pytest.raises(ValueError, match="--kv-offload-dir"):
        _offload_args(ns(kv_offload_size=1.0), 0)
