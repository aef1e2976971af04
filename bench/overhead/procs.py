"""Child processes: started on loopback, CPU read from /proc, always stopped.

Every child runs in its own session (Ctrl-C reaches only the benchmark, which stops
it), gets SIGTERM if the benchmark dies (``die_with_parent``), and is stopped with
SIGTERM, then SIGKILL after a bound, also when the stop itself is interrupted. CPU is
utime + stime of the child and every live descendant, plus what it reaped: a router
that forks workers is charged for them.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

from proxy.procutil import die_with_parent

HOST = "127.0.0.1"
STOP_TIMEOUT_S = 10.0  # SIGTERM, then SIGKILL after this
PROBLEM_MARKS = (" WARNING ", " WARN ", " ERROR ", " CRITICAL ", "Traceback", "panicked")
CLK_TCK = os.sysconf("SC_CLK_TCK")


class ChildFailed(Exception):
    pass


@dataclass
class Child:
    name: str
    argv: list[str]
    process: asyncio.subprocess.Process
    log_path: Path
    exit_code: int | None = None

    @property
    def pid(self) -> int:
        return self.process.pid

    def check_alive(self) -> None:
        if self.process.returncode is not None:
            raise ChildFailed(
                f"{self.name} exited with {self.process.returncode}; see {self.log_path}"
            )

    def cpu_s(self) -> float:
        return tree_cpu_s(self.pid)

    def log_problems(self) -> list[str]:
        """Lines at WARNING or above, tracebacks and panics, from the child's log."""
        text = self.log_path.read_text(errors="replace")
        lines = [_strip_ansi(line) for line in text.splitlines()]
        return [line for line in lines if any(m in line for m in PROBLEM_MARKS)]


def _strip_ansi(line: str) -> str:
    while "\x1b[" in line:
        head, _, tail = line.partition("\x1b[")
        line = head + tail.split("m", 1)[-1]
    return line


@asynccontextmanager
async def running(
    name: str,
    argv: Sequence[str],
    log_path: Path,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
) -> AsyncIterator[Child]:
    """Start ``argv`` with its output to ``log_path``; always stop it."""
    with log_path.open("wb") as log:
        process = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            start_new_session=True,
            preexec_fn=die_with_parent(),
            cwd=cwd,
        )
    child = Child(name, list(argv), process, log_path)
    try:
        yield child
    finally:
        child.exit_code = await stop(process, STOP_TIMEOUT_S)


async def stop(process: asyncio.subprocess.Process, timeout_s: float) -> int:
    """SIGTERM to the child's process group, then SIGKILL after ``timeout_s``."""
    try:
        if process.returncode is None:
            _signal(process, signal.SIGTERM)
            async with asyncio.timeout(timeout_s):
                return await process.wait()
        return process.returncode
    except TimeoutError:
        print(f"pid {process.pid} ignored SIGTERM for {timeout_s:g} s; killing it", file=sys.stderr)
        _signal(process, signal.SIGKILL)
        return await process.wait()
    except BaseException:  # interrupted while stopping: do not leave it behind
        _signal(process, signal.SIGKILL)
        raise


def _signal(process: asyncio.subprocess.Process, sig: signal.Signals) -> None:
    # The child leads its own session: the group holds it and any workers it forked.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, sig)


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
        if entry.name.isdigit():
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


def tree_cpu_s(root: int) -> float:
    """CPU seconds of ``root`` (all threads), its live descendants and what it reaped."""
    fields = _stat_fields(root)
    if fields is None:
        return 0.0
    ticks = sum(int(f) for f in fields[11:15])
    for pid in descendants(root):
        child = _stat_fields(pid)
        if child is not None:
            ticks += sum(int(f) for f in child[11:15])
    return ticks / CLK_TCK
