"""Children that die with their parent: Linux's parent-death signal (``PR_SET_PDEATHSIG``).

The kernel sends the signal to the child when the *thread* that forked it exits
(for a process killed with SIGKILL: at once), so a child started by ``serve`` or
the worker supervisor cannot outlive it and keep its port. Two uses: a worker
process asks for it itself (:func:`die_with`), and a ``subprocess.Popen`` child
gets it before it runs anything (:func:`preexec`), closing the window in which
the parent could die while the child still starts. Without ``prctl`` (not
Linux) both do nothing beyond the parent check.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
from collections.abc import Callable

PR_SET_PDEATHSIG = 1


def _prctl() -> Callable[[int, int], int] | None:
    with contextlib.suppress(OSError, AttributeError):
        return ctypes.CDLL(None, use_errno=True).prctl
    return None


def die_with(parent: int, sig: int = signal.SIGTERM) -> None:
    """Ask for ``sig`` when the parent dies; exit at once if ``parent`` is already gone."""
    prctl = _prctl()
    if prctl is not None:
        prctl(PR_SET_PDEATHSIG, sig)
    if os.getppid() != parent:
        os._exit(0)


def preexec(sig: int = signal.SIGTERM) -> Callable[[], None]:
    """A ``preexec_fn`` for ``subprocess.Popen``: the child gets ``sig`` when the calling thread
    exits. Everything is looked up here, in the parent, so the child only makes one call."""
    prctl = _prctl()
    parent = os.getpid()

    def in_child() -> None:
        if prctl is not None:
            prctl(PR_SET_PDEATHSIG, sig)
        if os.getppid() != parent:
            os._exit(0)

    return in_child
