"""Runtime directories: a run's own are locked while it lives; at the next start only those
whose owner died (SIGKILL included) are removed."""

from __future__ import annotations

import os
import subprocess
import sys

from gateway.config import runtime_dir

OWNER = """
import sys
sys.path.insert(0, {root!r})
from gateway.config import runtime_dir
print(runtime_dir.create("kv-events"), flush=True)
sys.stdin.read()
"""


def test_only_directories_of_dead_owners_are_removed(tmp_path) -> None:
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    owners = [subprocess.Popen([sys.executable, "-c", OWNER.format(root=os.getcwd())], env=env,
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        dead, alive = (type(tmp_path)(owner.stdout.readline().strip()) for owner in owners)
        assert dead.parent == tmp_path and dead.name.startswith("prefixgate-kv-events-")
        assert oct(dead.stat().st_mode & 0o777) == "0o700"
        owners[0].kill()
        owners[0].wait(60)
        unlocked = tmp_path / "prefixgate-old-version"  # no lock file: its owner cannot be told
        unlocked.mkdir()
        other = tmp_path / "something-else"
        other.mkdir()
        assert runtime_dir.clean_stale(tmp_path) == [dead]
        assert not dead.exists() and alive.exists() and unlocked.exists() and other.exists()
    finally:
        for owner in owners:
            owner.kill()
            owner.wait(60)
    assert runtime_dir.clean_stale(tmp_path) == [alive]  # once its owner is gone too


def test_a_directory_of_this_process_is_kept_until_removed(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)
    path = runtime_dir.create("metrics")
    try:
        assert path.parent == tmp_path and runtime_dir.clean_stale(tmp_path) == [] and path.exists()
    finally:
        runtime_dir.remove(path)
    assert not path.exists()
