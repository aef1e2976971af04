"""Child processes: free ports for them, and one launcher that starts, watches and stops.

Every child runs ``argv`` in a session of its own (Ctrl-C reaches only its parent, which
stops it in order), gets SIGTERM if the parent dies, even by SIGKILL
(``die_with_parent``), and writes stdout and stderr to one log file. Stopping is
SIGCONT (a stopped process cannot act on SIGTERM) and SIGTERM, then SIGKILL after a
bound, at once when the stop is hurried or is itself interrupted. ``group`` children
get every signal on their whole process group: the workers they forked too.

    async with running("gateway", python_m("gateway", ...), log_path) as gateway:
        await gateway.until_ready(20.0)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import re
import signal
import socket
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import aiohttp

log = logging.getLogger(__name__)

LOW_PORT = 10_000  # free ports are picked from here up to the kernel's ephemeral range
POLL_S = 0.05  # how often readiness is asked
PROBE_TIMEOUT = aiohttp.ClientTimeout(total=2.0)  # one readiness probe
PROBE_ERRORS = (aiohttp.ClientError, TimeoutError, ValueError, KeyError, TypeError)
PROBLEM_MARKS = (" WARNING ", " WARN ", " ERROR ", " CRITICAL ", "Traceback", "panicked")

Probe = Callable[[aiohttp.ClientSession], Awaitable[bool]]


class ChildFailed(Exception):
    """A child exited, or did not get ready in time; the message says which and why."""


def python_m(*args: str) -> list[str]:
    """The command line of ``python -m proxy ARGS`` on this interpreter."""
    return [sys.executable, "-m", "proxy", *args]


def describe_exit(code: int) -> str:
    return f"status {code}" if code >= 0 else f"signal {signal.Signals(-code).name}"


@dataclass(eq=False)  # one child is equal to itself only
class Child:
    """One started child: its process, its log, the addresses it serves once known."""

    name: str
    argv: list[str]
    log_path: Path
    process: asyncio.subprocess.Process
    group: bool = False  # signals go to its process group
    http_url: str = ""
    grpc_target: str = ""
    exit_code: int | None = None  # set by stop()

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def returncode(self) -> int | None:
        return self.process.returncode

    def signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if self.group:  # the group outlives its leader while a worker lives
                os.killpg(self.pid, sig)
            elif self.returncode is None:  # a reaped pid may be another process's now
                os.kill(self.pid, sig)

    async def wait(self, timeout_s: float | None = None) -> int:
        async with asyncio.timeout(timeout_s):
            return await self.process.wait()

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def cpu_s(self) -> float:
        """utime + stime of the child (all its threads), in seconds; 0 once it is gone."""
        try:
            stat = Path(f"/proc/{self.pid}/stat").read_text()
        except OSError:
            return 0.0
        fields = stat.rsplit(")", 1)[1].split()  # utime, stime: fields 14, 15
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def tail(self, lines: int = 15) -> str:
        return "\n".join(f"    {line}" for line in self.output().splitlines()[-lines:])

    def log_problems(self, marks: Sequence[str] = PROBLEM_MARKS) -> list[str]:
        """Lines at WARNING or above, tracebacks and panics, from the child's log."""
        lines = [_strip_ansi(line) for line in self.output().splitlines()]
        return [line for line in lines if any(m in line for m in marks)]

    def check_alive(self) -> None:
        if self.returncode is not None:
            raise ChildFailed(f"{self.name} exited ({describe_exit(self.returncode)}); "
                              f"its log, {self.log_path}, ends:\n{self.tail()}")  # fmt: skip

    async def wait_for_line(self, pattern: re.Pattern[bytes], timeout_s: float) -> re.Match[bytes]:
        """The first match of ``pattern`` in the log (a child on port 0 logs its address)."""
        try:
            async with asyncio.timeout(timeout_s):
                while not (match := pattern.search(self.log_path.read_bytes())):
                    self.check_alive()
                    await asyncio.sleep(POLL_S / 5)
        except TimeoutError:
            raise ChildFailed(f"{self.name} logged no {pattern.pattern!r} within "
                              f"{timeout_s:g} s; its log: {self.log_path}") from None  # fmt: skip
        return match

    async def until(self, probe: Probe, timeout_s: float, what: str = "ready") -> None:
        """Until ``probe`` returns True; ChildFailed if the child exits or time runs out."""
        last = "no answer"
        async with aiohttp.ClientSession(timeout=PROBE_TIMEOUT) as session:
            try:
                async with asyncio.timeout(timeout_s):
                    while True:
                        self.check_alive()
                        try:
                            if await probe(session):
                                return
                        except PROBE_ERRORS as exc:
                            last = f"{type(exc).__name__}: {exc}"
                        await asyncio.sleep(POLL_S)
            except TimeoutError:
                raise ChildFailed(f"{self.name} not {what} within {timeout_s:g} s ({last}); "
                                  f"its log: {self.log_path}") from None  # fmt: skip

    async def until_ready(self, timeout_s: float) -> None:
        """Until ``GET {http_url}/ready`` answers 200."""
        await self.until(ready(self.http_url), timeout_s)

    async def stop(self, timeout_s: float, hurry: asyncio.Event | None = None) -> int:
        """SIGCONT and SIGTERM; SIGKILL after ``timeout_s``, or at once once ``hurry`` is
        set or this stop is interrupted. Reaps the child; returns its exit status."""
        if self.returncode is None:
            try:
                self.signal(signal.SIGCONT)  # a stopped process cannot act on SIGTERM
                self.signal(signal.SIGTERM)
                if not await _exits_within(self.process, timeout_s, hurry):
                    log.warning("%s (pid %d) did not stop; killing it", self.name, self.pid)
                    self.signal(signal.SIGKILL)
                    await self.process.wait()
            except BaseException:
                self.signal(signal.SIGKILL)
                raise
        self.exit_code = self.process.returncode
        assert self.exit_code is not None
        return self.exit_code


def ready(url: str) -> Probe:
    """A probe: ``GET {url}/ready`` answers 200."""

    async def probe(session: aiohttp.ClientSession) -> bool:
        async with session.get(f"{url}/ready") as resp:
            return resp.status == 200

    return probe


async def start(
    name: str,
    argv: Sequence[str],
    log_path: Path,
    *,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    group: bool = False,
    append: bool = False,
) -> Child:
    """Start ``argv`` with its output to ``log_path`` (appended to, with ``append``)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab" if append else "wb") as out:
        process = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.DEVNULL, stdout=out, stderr=out, cwd=cwd,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            start_new_session=True, preexec_fn=die_with_parent(),
        )  # fmt: skip
    return Child(name, list(argv), log_path, process, group)


@asynccontextmanager
async def running(
    name: str,
    argv: Sequence[str],
    log_path: Path,
    *,
    stop_timeout_s: float = 10.0,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    group: bool = False,
    append: bool = False,
) -> AsyncIterator[Child]:
    """``start``, and stop the child on the way out, whatever happened."""
    child = await start(name, argv, log_path, env=env, cwd=cwd, group=group, append=append)
    try:
        yield child
    finally:
        await child.stop(stop_timeout_s)


async def _exits_within(
    process: asyncio.subprocess.Process, timeout_s: float, hurry: asyncio.Event | None
) -> bool:
    waits = {asyncio.ensure_future(process.wait())}
    if hurry is not None:
        waits.add(asyncio.ensure_future(hurry.wait()))
    try:
        await asyncio.wait(waits, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiting in waits:
            waiting.cancel()
    return process.returncode is not None


def _strip_ansi(line: str) -> str:
    while "\x1b[" in line:
        head, _, tail = line.partition("\x1b[")
        line = head + tail.split("m", 1)[-1]
    return line


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
