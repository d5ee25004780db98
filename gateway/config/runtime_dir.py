"""Per-run directories under the temp dir (``/tmp/prefixgate-<kind>-*``), and the stale ones.

A run of ``serve`` or ``gateway`` keeps a few private directories (KV-event
sockets, multi-process metrics, the shared warning history), each made by
:func:`create` with mode 0700. Invariant: while its owner process lives, each
holds ``.owner``, a file the owner keeps open with an exclusive ``flock``. The
kernel drops that lock when the owner dies however it dies (``kill -9`` included),
so :func:`clean_stale`, run at every start, removes exactly the directories whose
owner is gone: those whose lock it can take. Directories without a lock file (an
older version's: their owner cannot be told), live runs', other users' and
anything not named ``prefixgate-*`` are never touched. The lock file's descriptor is
close-on-exec, so children do not inherit the lock.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

PREFIX = "prefixgate-"
LOCK_NAME = ".owner"
_held: dict[Path, int] = {}  # directory -> descriptor of its locked .owner file


def create(kind: str) -> Path:
    """A new ``prefixgate-<kind>-*`` directory (0700) owned by this process until :func:`remove`."""
    path = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{kind}-"))
    fd = os.open(path / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.write(fd, f"{os.getpid()}\n".encode())
    _held[path] = fd
    return path


def remove(path: Path) -> None:
    """Delete a directory made by :func:`create` and release its lock."""
    shutil.rmtree(path, ignore_errors=True)
    fd = _held.pop(path, None)
    if fd is not None:
        os.close(fd)


def _is_stale(path: Path) -> bool:
    try:
        fd = os.open(path / LOCK_NAME, os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False  # its owner is alive
    finally:
        os.close(fd)
    return True


def clean_stale(root: Path | None = None) -> list[Path]:
    """Remove this user's ``prefixgate-*`` directories in ``root`` (the temp dir) whose owner is dead;
    the removed paths."""
    root = root or Path(tempfile.gettempdir())
    removed = []
    uid = os.getuid()
    for path in root.glob(f"{PREFIX}*"):
        try:
            if path.is_symlink() or not path.is_dir() or path.stat().st_uid != uid or path in _held:
                continue
        except OSError:
            continue
        if _is_stale(path):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    if removed:
        log.info("removed %d runtime director%s left by runs that died: %s", len(removed),
                 "y" if len(removed) == 1 else "ies", ", ".join(map(str, removed)))
    return removed
