"""What the bench programs share: the code version they record, how they run."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import os
import platform
import signal
import subprocess
from collections.abc import Awaitable, Coroutine, Sequence
from pathlib import Path
from types import FrameType
from typing import Any, TypeVar

import aiohttp

from proxy import procutil
from proxy.procutil import Probe

REPO = Path(__file__).resolve().parents[1]
CLK_TCK = os.sysconf("SC_CLK_TCK")
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


# -- CPU from /proc -------------------------------------------------------------------


def _stat_fields(pid: int) -> list[str] | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # After "comm)": state, ppid, ... utime (field 14) and stime (15) sit at 11, 12,
    # cutime and cstime (16, 17: reaped children) at 13, 14.
    return stat.rsplit(")", 1)[1].split()


def machine_busy_s() -> float:
    """CPU seconds every core of the machine spent busy so far (all processes, ours too)."""
    # "cpu user nice system idle iowait irq softirq steal ...": idle and iowait are not busy.
    fields = [int(f) for f in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    return (sum(fields) - fields[3] - fields[4]) / CLK_TCK


def descendants(root: int) -> list[int]:
    """Live processes below ``root``, found by walking every process's parent."""
    parents: dict[int, int] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isascii() and entry.name.isdigit():
            fields = _stat_fields(int(entry.name))
            if fields is not None:
                parents[int(entry.name)] = int(fields[1])
    found, frontier = [], [root]
    while frontier:
        parent = frontier.pop()
        children = [pid for pid, ppid in parents.items() if ppid == parent]
        found += children
        frontier += children
    return found


def tree(root: int) -> list[int]:
    """``root`` and its live descendants (one walk over /proc: read it once a reading)."""
    return [root, *descendants(root)]


def processes_cpu_s(pids: Sequence[int]) -> float:
    """CPU seconds of these processes (all threads) and of what each reaped."""
    ticks = 0
    for pid in pids:
        fields = _stat_fields(pid)
        if fields is not None:
            ticks += sum(int(f) for f in fields[11:15])
    return ticks / CLK_TCK


def tree_cpu_s(root: int) -> float:
    """CPU seconds of ``root`` (all threads), its live descendants and what it reaped."""
    return processes_cpu_s(tree(root))


def _thread_waits_ns(pid: int) -> int:
    """Nanoseconds the threads of ``pid`` now alive spent runnable without a CPU."""
    total = 0
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0
    for tid in tasks:
        # "time on the CPU, time waiting on a run queue, time slices", in ns; a thread
        # that ended in between has none.
        with contextlib.suppress(OSError, IndexError, ValueError):
            total += int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[1])
    return total


def run_queue_wait_s(pids: Sequence[int]) -> float | None:
    """Seconds the threads of these processes spent ready to run while every core was
    busy with something else (schedstat's run delay), so far; None where the kernel
    keeps no schedstat. Threads that ended take their share with them: read it over a
    window in which the processes' threads live throughout."""
    if not Path("/proc/self/schedstat").exists():
        return None
    return sum(_thread_waits_ns(pid) for pid in pids) / 1e9


# -- readiness beyond GET /ready --------------------------------------------------------

MODEL = "unitproxy-sim"  # the sim engine's served model


def answers(url: str, api_key: str | None = None) -> Probe:
    """A probe: a real completion comes back through ``url`` (a router whose /ready holds
    can still fail every request, say in a tree that is mid-edit)."""
    body = {"model": MODEL, "prompt": "ready?", "max_tokens": 2}
    headers = {} if api_key is None else {"Authorization": f"Bearer {api_key}"}

    async def probe(session: aiohttp.ClientSession) -> bool:
        async with session.post(f"{url}/v1/completions", json=body, headers=headers) as resp:
            return resp.status == 200 and bool((await resp.json())["choices"])

    return probe


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
