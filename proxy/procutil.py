"""Helpers for the child processes unitproxy starts."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable


def die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn``: on Linux the child gets SIGTERM when its parent dies, even by
    SIGKILL, so nothing is left orphaned. None elsewhere."""
    if sys.platform != "linux":
        return None
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl
    pr_set_pdeathsig = 1
    parent = os.getpid()

    # Resolved here, in the parent: the forked child only makes the calls.
    def arm() -> None:
        prctl(pr_set_pdeathsig, signal.SIGTERM)
        if os.getppid() != parent:  # the parent died before the call: no signal will come
            os.kill(os.getpid(), signal.SIGTERM)

    return arm
