"""What the bench programs share: the code version they record, how they run."""

from __future__ import annotations

import asyncio
import importlib.metadata
import os
import platform
import signal
import subprocess
from collections.abc import Awaitable, Coroutine
from pathlib import Path
from types import FrameType
from typing import Any, TypeVar

from proxy import procutil

REPO = Path(__file__).resolve().parents[1]
PRODUCT = ("proxy", "engine", "protos")
T = TypeVar("T")


def code_version() -> dict[str, Any]:
    """The commit of this tree and its uncommitted product files (others may edit them)."""

    def git(*args: str) -> str:
        try:
            done = subprocess.run(
                ["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10, check=True
            )
        except (OSError, subprocess.SubprocessError):
            return ""
        return done.stdout

    changed = git("status", "--porcelain", "--", *PRODUCT)
    return {
        "commit": git("rev-parse", "--short", "HEAD").strip(),
        "uncommitted": [line.split(maxsplit=1)[-1] for line in changed.splitlines()],
    }


def no_plot() -> str | None:
    """Why no PNG can be drawn here (None: it can). matplotlib is the bench extra."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return "no PNG: matplotlib is not installed (pip install -e '.[bench]')"
    return None


# -- ports -----------------------------------------------------------------------------

free_ports = procutil.free_ports  # below the ephemeral range: see its docstring


# -- CPU from /proc ---------------------------------------------------------------------


def cpu_s(pid: int) -> float:
    """utime + stime of a process (all its threads), in seconds; 0 once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    # Fields after "comm)": state is field 3, so utime (14) and stime (15) sit at 11, 12.
    fields = stat.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# -- running a bench: the loop, signals, what it ran on -------------------------------


class Interrupted(Exception):
    """SIGINT or SIGTERM arrived; raised so that every ``finally`` runs."""


def interrupt(signum: int, frame: FrameType | None) -> None:
    """A signal.signal handler for outside the loop: SIGTERM then acts like Ctrl-C."""
    raise Interrupted(signal.Signals(signum).name)


async def until_signal(main: Awaitable[T]) -> T:
    """Await ``main``; SIGINT or SIGTERM cancel it (its ``finally`` blocks stop every
    child) and raise Interrupted. Inside the loop a signal must cancel the task: an
    exception raised by a signal.signal handler would land in whatever callback runs."""
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None
    received: list[str] = []

    def on_signal(sig: signal.Signals) -> None:
        received.append(sig.name)
        task.cancel()

    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    for sig in previous:
        loop.add_signal_handler(sig, on_signal, sig)
    try:
        return await main
    except asyncio.CancelledError:
        if received:
            raise Interrupted(received[0]) from None
        raise
    finally:
        for sig, handler in previous.items():
            loop.remove_signal_handler(sig)
            signal.signal(sig, handler)


def run_loop(main: Coroutine[Any, Any, T]) -> T:
    """Run ``main`` on uvloop where it is installed, as the product does."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


def cpu_model() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name":
            return value.strip()
    return platform.processor() or "unknown"


def loop_name() -> str:
    try:
        return f"uvloop {importlib.metadata.version('uvloop')}"
    except importlib.metadata.PackageNotFoundError:
        return "asyncio"
