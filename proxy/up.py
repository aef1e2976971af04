"""``unitproxy up``: a whole local cell on loopback, as child processes.

Followers and sidecars start first, then the gateway. Once every sidecar answers
``GET /ready`` with 200, and the gateway does too and sees every unit SERVING, a table
of the processes is printed and written as JSON to the state file. By default nothing
is supervised: a child that exits is logged and left so, to be watched. With
``restart`` a child that exits is started again on the same ports after a backoff
(1 s, doubling to 30 s; back to 1 s once it ran for 30 s) and the state file is
rewritten with its new pid. SIGINT or SIGTERM stops every child, restarted ones
included (SIGTERM, then SIGKILL after the stop timeout, or at once on a second
signal), and removes the state file.

The gateway and the sidecars share a ``server.resume_secret`` (the one given, else a
new random one for each start of the cell), in their environment: the gateway signs
the resume hints of the streams it moves off a failed unit, and the sidecars take no
other.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import sys
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import aiohttp
from pydantic import BaseModel, SecretStr

from proxy import procutil
from proxy.flags import ENGINE, GATEWAY, HEALTH, SIDECAR, TRACING, Flag
from proxy.procutil import describe_exit, free_ports
from proxy.serving import Signals
from proxy.settings import Settings, UpSettings

log = logging.getLogger(__name__)

HOST = "127.0.0.1"
POLL_INTERVAL_S = 0.2
RESTART_BACKOFF_S = (1.0, 30.0)  # first and longest wait before starting a dead child again
TAIL_BYTES = 8192  # how much of a child's log is read for its last line
# Flags whose values, when set by flag, environment or file, go on to the children.
TO_SIDECARS = (*ENGINE, *(f for f in SIDECAR if f.flag == "--capacity"), *HEALTH, *TRACING)
TO_FOLLOWERS = HEALTH
TO_GATEWAY = (*(f for f in GATEWAY if f.flag in ("--policy", "--tenants-file")), *TRACING)


@dataclass
class Child:
    role: str  # gateway, sidecar or follower
    name: str  # "gateway", the unit id or the node name
    unit: str  # "" for the gateway
    http_port: int
    grpc_port: int
    args: list[str]  # after ``python -m proxy``
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)  # secrets: never on a command line
    proc: procutil.Child | None = None

    @property
    def http_url(self) -> str:
        return f"http://{HOST}:{self.http_port}"

    @property
    def grpc_target(self) -> str:
        return f"{HOST}:{self.grpc_port}"

    @property
    def pid(self) -> int:
        assert self.proc is not None, "not started"
        return self.proc.pid

    @property
    def title(self) -> str:
        return self.role if self.name == self.role else f"{self.role} {self.name}"

    def endpoints(self) -> dict[str, Any]:
        return {"http": self.http_url, "grpc": self.grpc_target, "pid": self.pid}


@dataclass
class Unit:
    unit_id: str
    sidecar: Child
    followers: list[Child] = field(default_factory=list)


@dataclass
class Cell:
    gateway: Child
    units: list[Unit]

    @property
    def children(self) -> list[Child]:
        """Every process in start order: followers, sidecars, the gateway last."""
        followers = [f for u in self.units for f in u.followers]
        return [*followers, *(u.sidecar for u in self.units), self.gateway]

    def state(self) -> dict[str, Any]:
        """The state file's JSON (docs/api.md)."""
        return {
            "gateway": self.gateway.endpoints(),
            "units": [
                {
                    "unit_id": u.unit_id,
                    "sidecar": u.sidecar.endpoints(),
                    "followers": [
                        {"node": f.name, "grpc": f.grpc_target, "http": f.http_url, "pid": f.pid}
                        for f in u.followers
                    ],
                }
                for u in self.units
            ],
        }


def plan(settings: Settings, ports: Iterator[int]) -> Cell:
    """Names, ports, command lines and log files of every process; starts nothing."""
    up = settings.up
    logs = up.state_file.parent / "logs"
    common = ["--host", HOST, "--log-level", settings.server.log_level]

    def child(role: str, name: str, unit: str, args: list[str]) -> Child:
        http_port, grpc_port = next(ports), next(ports)
        ports_args = ["--http-port", str(http_port), "--grpc-port", str(grpc_port)]
        log_path = logs / (f"{role}.log" if role == name else f"{role}-{name}.log")
        argv = [role, *common, *ports_args, *args]
        return Child(role, name, unit, http_port, grpc_port, argv, log_path)

    gateway = child("gateway", "gateway", "", [])  # its --unit flags follow below
    shared = {RESUME_SECRET_ENV: resume_secret(settings)}
    gateway.env = dict(shared)
    units = []
    for i in range(up.units):
        unit_id = f"unit-{i}"
        followers = [
            child("follower", f"u{i}-f{j}", unit_id, ["--node-name", f"u{i}-f{j}"])
            for j in range(up.followers)
        ]
        follower_args = [a for f in followers for a in ("--follower", f"{f.name}={f.grpc_target}")]
        sidecar = child("sidecar", unit_id, unit_id, ["--unit-id", unit_id, *follower_args])
        sidecar.args += given_flags(settings, TO_SIDECARS)
        if up.unit_models:  # after the engine flags: it wins over --served-model-name
            sidecar.args += ["--served-model-name", up.unit_models[i % len(up.unit_models)]]
        sidecar.env = {**given_secrets(settings, TO_SIDECARS), **shared}
        for f in followers:
            f.args += given_flags(settings, TO_FOLLOWERS)
        units.append(Unit(unit_id, sidecar, followers))
    for u in units:
        gateway.args += ["--unit", f"{u.unit_id}={u.sidecar.http_url},{u.sidecar.grpc_target}"]
    gateway.args += given_flags(settings, TO_GATEWAY)
    return Cell(gateway, units)


RESUME_SECRET_ENV = "UNITPROXY_SERVER__RESUME_SECRET"


def resume_secret(settings: Settings) -> str:
    """The cell's server.resume_secret: the one given, else a new one."""
    given = settings.server.resume_secret
    return secrets.token_hex(32) if given is None else given.get_secret_value()


# Passed in the environment: a command line is visible to every user of the machine
# (`ps`), and engine_args may carry a token.
SECRET_KEYS = frozenset({"engine.engine_args"})


def given_flags(settings: Settings, flags: Iterable[Flag]) -> list[str]:
    """The command-line flags for the values that were set (by flag, env or file),
    secrets left out (see given_secrets)."""
    argv: list[str] = []
    for f, value in _given(settings, flags):
        if not _secret(f, value):
            assert not f.many, f"{f.flag}: repeatable flags are not passed on"
            if f.switch:
                argv += [f.flag] if value else []
            else:
                argv += [f.flag, _flag_value(value)]
    return argv


def given_secrets(settings: Settings, flags: Iterable[Flag]) -> dict[str, str]:
    """The environment variables for the secret values that were set."""
    return {
        "UNITPROXY_" + "__".join(f.key.split(".")).upper(): _flag_value(value)
        for f, value in _given(settings, flags)
        if _secret(f, value)
    }


def _given(settings: Settings, flags: Iterable[Flag]) -> Iterator[tuple[Flag, object]]:
    for f in flags:
        *path, name = f.key.split(".")
        section: BaseModel = settings
        for part in path:
            section = getattr(section, part)
        value = getattr(section, name)
        if name in section.model_fields_set and value is not None:
            yield f, value


def _secret(f: Flag, value: object) -> bool:
    return isinstance(value, SecretStr) or f.key in SECRET_KEYS


def _flag_value(value: object) -> str:
    """A settings value as the command line writes it (tables as JSON, secrets revealed)."""
    if isinstance(value, SecretStr):
        return value.get_secret_value()
    if isinstance(value, dict | list):
        return json.dumps(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def allocate_ports(up: UpSettings) -> Iterator[int]:
    """Ports counted up from ``base_port``, or free ones below the ephemeral range."""
    if up.base_port is not None:
        return iter(range(up.base_port, up.base_port + up.port_count))
    return iter(free_ports(up.port_count, HOST))


class Processes:
    """The running children: started on enter, each watched, all stopped on exit.

    ``restarted`` (when given) makes the watchers start a dead child again after a
    backoff, and is called after each restart (to rewrite the state file).
    """

    def __init__(
        self,
        children: Sequence[Child],
        stop_timeout_s: float,
        hurry: asyncio.Event,
        restarted: Callable[[Child], Awaitable[None]] | None = None,
    ):
        self.children = list(children)
        self.stop_timeout_s = stop_timeout_s
        self.hurry = hurry
        self.stopping = False
        self.supervising = False  # set once the cell is ready: restarts only after that
        self._restarted = restarted
        self._spawning = asyncio.Lock()  # a restart and a stop never overlap
        self._watchers: list[asyncio.Task[None]] = []

    async def __aenter__(self) -> Self:
        try:
            for child in self.children:
                await self._spawn(child)
        except BaseException:
            await self.stop()
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    async def _spawn(self, child: Child) -> None:
        await self._exec(child)
        log.debug("started %s (pid %d): %s", child.title, child.pid, " ".join(child.args))
        self._watchers.append(asyncio.create_task(self._watch(child), name=f"watch {child.title}"))

    async def _exec(self, child: Child, restart: bool = False) -> None:
        if restart:
            with child.log_path.open("a") as out:
                out.write(f"\n--- unitproxy up: restarting {child.title} ---\n")
        argv = procutil.python_m(*child.args)
        child.proc = await procutil.start(child.title, argv, child.log_path, env=child.env,
                                          append=restart)  # fmt: skip

    async def _watch(self, child: Child) -> None:
        assert child.proc is not None
        loop = asyncio.get_running_loop()
        started, failures = loop.time(), 0
        while True:
            code = await child.proc.wait()
            if self.stopping:
                log.debug("%s (pid %d) stopped: %s", child.title, child.pid, describe_exit(code))
                return
            last = last_line(child.log_path)
            if self._restarted is None or not self.supervising:
                log.warning("%s (pid %d) exited: %s%s; not restarted; its log: %s",
                            child.title, child.pid, describe_exit(code), last,
                            child.log_path)  # fmt: skip
                return
            first, most = RESTART_BACKOFF_S
            failures = 0 if loop.time() - started >= most else failures + 1
            wait_s = min(first * 2 ** max(failures - 1, 0), most)
            log.warning("%s (pid %d) exited: %s%s; restarting it in %g s; its log: %s",
                        child.title, child.pid, describe_exit(code), last, wait_s,
                        child.log_path)  # fmt: skip
            await asyncio.sleep(wait_s)
            async with self._spawning:
                if self.stopping:
                    return
                await self._restart(child)
            started = loop.time()
            await self._restarted(child)

    async def _restart(self, child: Child) -> None:
        old = child.pid
        await self._exec(child, restart=True)
        log.info("restarted %s (pid %d, was %d) on the same ports", child.title, child.pid, old)

    def exited(self) -> list[Child]:
        return [c for c in self.children if c.proc is not None and c.proc.returncode is not None]

    async def stop(self) -> None:
        """SIGTERM to every child still running; SIGKILL what is left after the timeout."""
        self.stopping = True
        async with self._spawning:  # a restart under way has its new process in hand
            running = [
                c.proc for c in self.children if c.proc is not None and c.proc.returncode is None
            ]
        await asyncio.gather(*(p.stop(self.stop_timeout_s, self.hurry) for p in running))
        for task in self._watchers:
            task.cancel()
        await asyncio.gather(*self._watchers, return_exceptions=True)
        if running:
            log.info("stopped %d processes", len(running))


def last_line(path: Path) -> str:
    """': ' and the last line a child wrote (a traceback's last line names the error)."""
    try:
        with path.open("rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - TAIL_BYTES))
            lines = [line.strip() for line in f.read().decode(errors="replace").splitlines()]
    except OSError:
        return ""
    lines = [line for line in lines if line]
    return f": {lines[-1][:300]}" if lines else ""


class NotReady(Exception):
    """The cell did not get ready; one line per process that failed."""


async def wait_ready(cell: Cell, procs: Processes, timeout_s: float) -> None:
    """Until every sidecar answers GET /ready with 200 and the gateway does too and lists
    every unit SERVING in GET /units; fail at once when a child exits, and after
    ``timeout_s`` naming what was not ready and its log file."""
    pending = [*(u.sidecar for u in cell.units), cell.gateway]
    unit_ids = [u.unit_id for u in cell.units]
    last: dict[str, str] = {}
    timeout = aiohttp.ClientTimeout(total=1.0)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def why_not(child: Child) -> str:
            why = await _not_ready(session, child.http_url)
            if not why and child is cell.gateway:
                why = await _units_not_serving(session, child.http_url, unit_ids)
            return why

        try:
            async with asyncio.timeout(timeout_s):
                while pending:
                    if exited := procs.exited():
                        raise NotReady("\n".join(_exited_line(c) for c in exited))
                    answers = await asyncio.gather(*(why_not(c) for c in pending))
                    last.update((c.title, why) for c, why in zip(pending, answers, strict=True))
                    pending = [c for c, why in zip(pending, answers, strict=True) if why]
                    if pending:
                        await asyncio.sleep(POLL_INTERVAL_S)
        except TimeoutError:
            lines = [f"{c.title} not ready within {timeout_s:g} s ({last.get(c.title, 'no answer')}); "
                     f"its log: {c.log_path}" for c in pending]  # fmt: skip
            raise NotReady("\n".join(lines)) from None


def _exited_line(child: Child) -> str:
    assert child.proc is not None and child.proc.returncode is not None
    code = describe_exit(child.proc.returncode)
    return (f"{child.title} exited ({code}) while the cell was starting{last_line(child.log_path)}; "
            f"its log: {child.log_path}")  # fmt: skip


async def _not_ready(session: aiohttp.ClientSession, url: str) -> str:
    """'' when GET /ready answers 200, else why not."""
    try:
        async with session.get(f"{url}/ready") as response:
            if response.status == 200:
                return ""
            body = await response.json(content_type=None)
            state = body.get("state", "") if isinstance(body, dict) else ""
            return f"GET /ready: {response.status} {state}".strip()
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        return f"GET /ready: {type(exc).__name__}"


async def _units_not_serving(
    session: aiohttp.ClientSession, url: str, unit_ids: Sequence[str]
) -> str:
    """'' when the gateway's GET /units lists every unit SERVING, else which are not."""
    try:
        async with session.get(f"{url}/units") as response:
            body = await response.json(content_type=None)
        states = {u["id"]: u["state"] for u in body["units"]}
    except (aiohttp.ClientError, TimeoutError, ValueError, TypeError, KeyError) as exc:
        return f"GET /units: {type(exc).__name__}"
    waiting = [i for i in unit_ids if states.get(i) != "SERVING"]
    return f"GET /units: {', '.join(waiting)} not SERVING yet" if waiting else ""


def table(cell: Cell) -> str:
    """One row per process: the gateway, then each unit's sidecar and followers."""
    rows = [("role", "unit", "node", "pid", "http", "grpc", "log")]
    for c in [cell.gateway, *(c for u in cell.units for c in (u.sidecar, *u.followers))]:
        node = {"gateway": "-", "sidecar": "leader"}.get(c.role, c.name)
        rows.append((c.role, c.unit or "-", node, str(c.pid), c.http_url, c.grpc_target,
                     str(c.log_path)))  # fmt: skip
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip()
                     for r in rows)  # fmt: skip


def write_state(path: Path, state: dict[str, Any]) -> None:
    """Atomically: a reader sees the old file or the whole new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(state, indent=2) + "\n")
    os.replace(tmp, path)


async def run_up(settings: Settings) -> int:
    try:
        return await _run(settings)
    except OSError as exc:  # the log or state directory cannot be written, say
        print(f"unitproxy up: {exc}", file=sys.stderr)
        return 1


async def _run(settings: Settings) -> int:
    up = settings.up
    cell = plan(settings, allocate_ports(up))

    async def restarted(child: Child) -> None:
        await asyncio.to_thread(write_state, up.state_file, cell.state())

    with Signals() as signals:
        procs = Processes(
            cell.children, up.stop_timeout_s, signals.hurry, restarted if up.restart else None
        )
        async with procs:
            log.info("started %d processes; waiting for them to be ready", len(procs.children))
            ready = asyncio.create_task(wait_ready(cell, procs, up.ready_timeout_s))
            stop = asyncio.create_task(signals.stop.wait())
            await asyncio.wait({ready, stop}, return_when=asyncio.FIRST_COMPLETED)
            stop.cancel()
            if not ready.done():
                ready.cancel()
                await asyncio.gather(ready, return_exceptions=True)
                log.info("received %s before the cell was ready; stopping", signals.name())
                return 0
            try:
                ready.result()
            except NotReady as exc:
                for line in str(exc).splitlines():
                    print(f"unitproxy up: {line}", file=sys.stderr)
                print("unitproxy up: stopping every process", file=sys.stderr)
                return 1
            procs.supervising = True
            print(table(cell), flush=True)
            try:
                await asyncio.to_thread(write_state, up.state_file, cell.state())
                log.info("cell ready: gateway %s, state in %s; %sCtrl-C stops it",
                         cell.gateway.http_url, up.state_file,
                         "dead processes are restarted; " if up.restart else "")  # fmt: skip
                await signals.stop.wait()
                log.info("received %s, stopping every process", signals.name())
            finally:
                await procs.stop()
                with contextlib.suppress(FileNotFoundError):
                    up.state_file.unlink()  # its pids are gone
    return 0
