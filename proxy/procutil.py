"""Helpers for the child processes unitproxy starts."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import sys
from collections.abc import Callable
from pathlib import Path

LOW_PORT = 10_000  # free ports are picked from here up to the kernel's ephemeral range


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


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct free ports below the kernel's ephemeral range, held together while
    chosen. A port picked with bind(0) comes from the ephemeral range: until the server
    meant for it binds, an outgoing connection (a gateway already dialling that very
    unit, any other program) or another bind(0) may take it, and the server fails with
    "address in use". Below that range only a bind on purpose can take it."""
    high = _ephemeral_low()
    picked: list[int] = []
    with contextlib.ExitStack() as stack:
        for port in random.sample(range(LOW_PORT, high), min(high - LOW_PORT, 50 * n + 50)):
            sock = stack.enter_context(socket.socket())
            try:
                sock.bind((host, port))
            except OSError:
                continue
            picked.append(port)
            if len(picked) == n:
                return picked
    raise OSError(f"no {n} free ports between {LOW_PORT} and {high}")


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default; elsewhere the range starts higher
