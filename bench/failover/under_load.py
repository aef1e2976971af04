"""Failover under streaming load: what clients see when a unit fails, and how fast.

Each repetition starts a fresh cell on 127.0.0.1: N units (``python -m proxy
follower`` and ``python -m proxy sidecar --engine sim --follower f1=TARGET`` each)
behind one ``python -m proxy gateway``, sidecar and gateway ports chosen free
beforehand (a restarted sidecar comes back on its own). C clients in this process
stream back to back through the gateway (chat and completions in turn, each stream its
own prompt, usage asked for, a deadline in x-unitproxy-timeout-ms), and an observer
polls the gateway's /units every 10 ms.

Scenarios:

    follower-kill            SIGKILL the follower agent of unit u0; it stays dead
    follower-stop            SIGSTOP it (a node that hangs: no answer, no close)
    sidecar-kill             SIGKILL the sidecar of unit u0 (its connections are cut)
    rolling-restart          each unit in turn: SIGTERM its sidecar (drain), wait for it
                             to exit, start it again on the same ports, wait until the
                             gateway routes to it again (SERVING and not ejected), next
    rolling-restart-serving  the same, but the next unit drains as soon as the gateway
                             shows the last one SERVING, ejected or not

Every stream that ended is then checked against its reference: the same request,
not streamed, answered by a fresh sidecar that never failed (the simulator's text is a
function of its seed, the prompt and the text before, so a stream continued on another
unit must match it token for token), text and usage alike.

Reported per scenario (over all repetitions): streams, client-visible errors, streams
whose text or usage differs from the reference, migrations (the gateway's counter), the
pause at the seam (the longest gap between two events of each stream that was on the
faulty unit at the fault, as its client saw it; and the gateway's own
migration_pause_seconds), and per fault, from just before ``os.kill`` (monotonic clock
of this process):

    away (log)    the gateway's log line "unit X: SERVING -> ..." (ms timestamps)
    away (poll)   the first /units poll that shows the unit not SERVING
    last routed   the last /units poll in which the unit's routed counter went up

    .venv/bin/python bench/failover/under_load.py            # a few minutes
    .venv/bin/python bench/failover/under_load.py --quick    # 1 repetition, 16 short streams
    .venv/bin/python bench/failover/under_load.py --scenarios follower-kill --repeat 5

It writes JSON (--out) and a PNG of the seam pauses beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import platform
import re
import secrets
import shlex
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: make the bench package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import aiohttp

from bench.common import Interrupted, cpu_model, free_ports, loop_name, run_loop, until_signal
from proxy import procutil
from proxy.procutil import Child, ChildFailed, python_m

REPO = Path(__file__).resolve().parents[2]
DEFAULT_OUT = REPO / "bench" / "results" / "failover_under_load.json"
HOST = "127.0.0.1"
DEADLINE_MS = 30_000
START_TIMEOUT_S = 20.0
STOP_TIMEOUT_S = 10.0  # SIGCONT + SIGTERM, then SIGKILL after this
POLL_S = 0.01
SIM = ["--sim-decode-ms-per-seq", "0",
       "--sim-prefill-ms-per-token", "0"]  # fmt: skip
FOLLOWER_LINE = re.compile(rb"gRPC health (\S+), HTTP (\S+),")
# The gateway stops routing to a unit on either line: its report says so, or it is gone.
AWAY = re.compile(
    r"^(\S+ \S+) \S+ proxy\.gateway\.router: unit (\S+): "
    r"(?:SERVING -> (\S+)|no load report \((.*)\))"
)


# -- child processes ------------------------------------------------------------------
# The shared launcher, not ``unitproxy up``: a scenario kills one process of a unit and
# starts a drained sidecar again on its ports, which up does not do on demand.


# The gateway signs the resume hints of the streams it moves with the secret it shares
# with the sidecars (server.resume_secret), as `unitproxy up` sets it up.
CELL_ENV = {"UNITPROXY_SERVER__RESUME_SECRET": secrets.token_hex(32)}


@asynccontextmanager
async def running(name: str, args: Sequence[str], log: Path) -> AsyncIterator[Child]:
    """``python -m proxy ARGS``, output added to ``log`` (a restarted sidecar's goes on
    after the last one's); stopped on the way out, whatever happened."""
    argv = python_m(*args)
    async with procutil.running(
        name, argv, log, cwd=REPO, stop_timeout_s=STOP_TIMEOUT_S, append=True, env=CELL_ENV
    ) as child:
        yield child


# -- the cell -------------------------------------------------------------------------


@dataclass(slots=True)
class UnitProcs:
    id: str
    http_port: int
    grpc_port: int
    follower_target: str
    step_ms: float = 10.0
    follower: Child | None = None
    sidecar: Child | None = None

    @property
    def http_url(self) -> str:
        return f"http://{HOST}:{self.http_port}"

    def sidecar_args(self) -> list[str]:
        return ["sidecar", "--host", HOST, "--http-port", str(self.http_port),
                "--grpc-port", str(self.grpc_port), "--unit-id", self.id,
                "--follower", f"f1={self.follower_target}",
                "--sim-decode-step-ms", str(self.step_ms), *SIM]  # fmt: skip


@dataclass(slots=True)
class Cell:
    units: list[UnitProcs]
    gateway: Child
    gateway_url: str
    workdir: Path
    stack: AsyncExitStack
    exits: dict[str, list[int]] = field(default_factory=dict)

    async def start_sidecar(self, http: aiohttp.ClientSession, unit: UnitProcs) -> None:
        log = self.workdir / f"{unit.id}.sidecar.log"
        unit.sidecar = await self.stack.enter_async_context(
            running(f"sidecar {unit.id}", unit.sidecar_args(), log)
        )
        unit.sidecar.http_url = unit.http_url
        await unit.sidecar.until_ready(START_TIMEOUT_S)


async def start_cell(
    http: aiohttp.ClientSession, n: int, workdir: Path, stack: AsyncExitStack, step_ms: float
) -> Cell:
    ports = free_ports(2 * n + 2)
    units = []
    for i in range(n):
        log = workdir / f"u{i}.follower.log"
        args = ["follower", "--host", HOST, "--http-port", "0", "--grpc-port", "0",
                "--node-name", "f1"]  # fmt: skip
        follower = await stack.enter_async_context(running(f"follower u{i}", args, log))
        target = (await follower.wait_for_line(FOLLOWER_LINE, START_TIMEOUT_S))[1].decode()
        unit = UnitProcs(f"u{i}", ports[2 * i], ports[2 * i + 1], target, step_ms)
        unit.follower = follower
        units.append(unit)
    gw_http, gw_grpc = ports[-2:]
    flags = [f for u in units for f in ("--unit", f"{u.id}={u.http_url},{HOST}:{u.grpc_port}")]
    args = ["gateway", "--host", HOST, "--http-port", str(gw_http), "--grpc-port", str(gw_grpc),
            *flags]  # fmt: skip
    # Entered before the sidecars, so stopped after them: it sees every drain.
    gateway = await stack.enter_async_context(running("gateway", args, workdir / "gateway.log"))
    gateway.http_url = f"http://{HOST}:{gw_http}"
    cell = Cell(units, gateway, gateway.http_url, workdir, stack)
    for unit in units:
        await cell.start_sidecar(http, unit)
    await gateway.until_ready(START_TIMEOUT_S)
    await every_unit_serving(http, cell.gateway_url)
    return cell


async def every_unit_serving(http: aiohttp.ClientSession, gateway_url: str) -> None:
    """The gateway's /ready needs one unit; the load must start with all of them."""
    async with asyncio.timeout(START_TIMEOUT_S):
        while True:
            async with http.get(f"{gateway_url}/units") as resp:
                units = (await resp.json())["units"]
            if all(u["state"] == "SERVING" and not u["ejected_for_s"] for u in units):
                return
            await asyncio.sleep(0.05)


# -- load and observation -------------------------------------------------------------


@dataclass(slots=True)
class Result:
    kind: str  # "ok", or what the client saw instead
    unit: str | None  # the unit that answered first (x-unitproxy-unit)
    started: float
    ended: float
    route: str = ""
    body: dict[str, Any] = field(default_factory=dict)
    text: str = ""
    usage: dict[str, int] | None = None
    max_gap_s: float = 0.0  # the longest wait between two events, the first excluded
    check: str = ""  # against the reference: "same", or what differs


def stream_body(route: str, prompt: str, tokens: int) -> dict[str, Any]:
    body: dict[str, Any] = {"max_tokens": tokens, "stream": True,
                            "stream_options": {"include_usage": True}}  # fmt: skip
    if route == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


def read_chunk(route: str, payload: bytes, result: Result) -> str | None:
    """Add one event to ``result``; the error type if it is an error event."""
    chunk = json.loads(payload)
    if "error" in chunk:
        return str(chunk["error"].get("type"))
    if chunk.get("usage"):
        result.usage = chunk["usage"]
    for choice in chunk.get("choices") or ():
        piece = choice["delta"].get("content") if route == "chat" else choice.get("text")
        result.text += piece or ""
    return None


async def one_stream(
    http: aiohttp.ClientSession, url: str, route: str, prompt: str, tokens: int
) -> Result:
    body = stream_body(route, prompt, tokens)
    result = Result("", None, time.monotonic(), 0.0, route, body)
    path = "/v1/chat/completions" if route == "chat" else "/v1/completions"
    try:
        async with asyncio.timeout(DEADLINE_MS / 1000 + 5):
            headers = {"x-unitproxy-timeout-ms": str(DEADLINE_MS)}
            async with http.post(f"{url}{path}", json=body, headers=headers) as resp:
                result.unit = resp.headers.get("x-unitproxy-unit")
                if resp.status != 200:
                    code = (await resp.json()).get("error", {}).get("code", "")
                    result.kind = f"HTTP {resp.status} {code}".strip()
                else:
                    result.kind = await read_stream(resp, route, result)
    except TimeoutError:
        result.kind = "hung past its deadline"
    except aiohttp.ClientError as exc:
        result.kind = f"connection error: {type(exc).__name__}"
    result.ended = time.monotonic()
    return result


async def read_stream(resp: aiohttp.ClientResponse, route: str, result: Result) -> str:
    last = None
    async for line in resp.content:
        if not line.startswith(b"data: "):
            continue
        now = time.monotonic()
        if last is not None:
            result.max_gap_s = max(result.max_gap_s, now - last)
        last = now
        payload = line[6:].strip()
        if payload == b"[DONE]":
            return "ok"
        error = read_chunk(route, payload, result)
        if error is not None:
            return f"SSE error event: {error}"
    return "stream cut without an error event"


class Load:
    def __init__(self, http: aiohttp.ClientSession, url: str, clients: int, tokens: int):
        self.results: list[Result] = []
        self._stop = asyncio.Event()
        self._tasks = [
            asyncio.create_task(self._loop(http, url, client, tokens)) for client in range(clients)
        ]

    async def _loop(self, http: aiohttp.ClientSession, url: str, client: int, tokens: int) -> None:
        for n in itertools.count():
            if self._stop.is_set():
                return
            route = "chat" if (client + n) % 2 else "completions"
            prompt = f"Client {client}, stream {n}: tell the story of unit {client * 7 + n}."
            self.results.append(await one_stream(http, url, route, prompt, tokens))

    async def stop(self) -> list[Result]:
        self._stop.set()
        await asyncio.gather(*self._tasks)
        return self.results


async def check_references(
    http: aiohttp.ClientSession, url: str, results: list[Result], concurrency: int = 8
) -> None:
    """Ask a sidecar that never failed for every finished stream, not streamed."""
    todo = [r for r in results if r.kind == "ok"]
    gate = asyncio.Semaphore(concurrency)

    async def one(result: Result) -> None:
        body = {k: v for k, v in result.body.items() if k not in ("stream", "stream_options")}
        path = "/v1/chat/completions" if result.route == "chat" else "/v1/completions"
        async with gate, http.post(f"{url}{path}", json=body) as resp:
            answer = await resp.json()
        choice = answer["choices"][0]
        text = choice["message"]["content"] if result.route == "chat" else choice["text"]
        differs = []
        if text != result.text:
            differs.append("text")
        if result.usage != answer["usage"]:
            differs.append("usage")
        result.check = " and ".join(differs) or "same"

    await asyncio.gather(*(one(r) for r in todo))


@dataclass(slots=True)
class Sample:
    at: float
    state: str | None
    routed: int
    ejected: bool


class Observer:
    """Polls the gateway's /units; keeps every sample of every unit."""

    def __init__(self, http: aiohttp.ClientSession, url: str):
        self.samples: dict[str, list[Sample]] = {}
        self._task = asyncio.create_task(self._poll(http, url))

    async def _poll(self, http: aiohttp.ClientSession, url: str) -> None:
        while True:
            with contextlib.suppress(aiohttp.ClientError):
                async with http.get(f"{url}/units") as resp:
                    body = await resp.json()
                now = time.monotonic()
                for u in body["units"]:
                    sample = Sample(now, u["state"], u["routed"], u["ejected_for_s"] > 0)
                    self.samples.setdefault(u["id"], []).append(sample)
            await asyncio.sleep(POLL_S)

    def latest(self, unit: str) -> Sample | None:
        samples = self.samples.get(unit)
        return samples[-1] if samples else None

    async def until(self, unit: str, routable: bool, timeout_s: float = 30) -> float:
        """Wait for a sample showing the unit SERVING (and, if asked, not ejected)."""
        seen = len(self.samples.get(unit, []))
        async with asyncio.timeout(timeout_s):
            while True:
                for s in self.samples.get(unit, [])[seen:]:
                    if s.state == "SERVING" and not (routable and s.ejected):
                        return s.at
                seen = len(self.samples.get(unit, []))
                await asyncio.sleep(POLL_S)

    def first_away(self, unit: str, after: float) -> float | None:
        return next(
            (s.at for s in self.samples[unit] if s.at >= after and s.state != "SERVING"), None
        )

    def last_routed(self, unit: str, after: float, until: float) -> float | None:
        """The first sample after the unit's routed counter last went up in the window."""
        window = [s for s in self.samples[unit] if s.at <= until]
        last = None
        for prev, cur in itertools.pairwise(window):
            if cur.at >= after and cur.routed > prev.routed:
                last = cur.at
        return last

    def ejected_during(self, unit: str, after: float, until: float) -> bool:
        return any(s.ejected for s in self.samples[unit] if after <= s.at <= until)

    async def close(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)


def gateway_away_lines(log: Path) -> list[tuple[float, str, str]]:
    """(wall-clock time, unit, why) of each line where the gateway stops routing to a unit:
    "SERVING -> X", or "no load report (...)"."""
    found = []
    for line in log.read_text(errors="replace").splitlines():
        if match := AWAY.match(line):
            stamp, ms = match[1].split(",")
            at = time.mktime(time.strptime(stamp, "%Y-%m-%d %H:%M:%S")) + int(ms) / 1000
            found.append((at, match[2], match[3] or match[4]))
    return found


# -- faults ---------------------------------------------------------------------------


@dataclass(slots=True)
class Fault:
    unit: str
    what: str
    at: float  # time.monotonic(), just before os.kill
    wall: float  # time.time(), the same moment
    ended: float = 0.0  # when the scenario stopped watching this fault
    down_until: float = 0.0  # the unit was down until then (restarted or watch ended)
    away_because: str = ""  # the gateway's log: the new state, or why the report went
    drain_s: float | None = None  # SIGTERM -> the sidecar exited
    exit_code: int | None = None
    ready_s: float | None = None  # restart -> the new sidecar's /ready says 200
    serving_again_s: float | None = None  # restart -> SERVING at the gateway
    routable_again_s: float | None = None  # restart -> SERVING and not ejected
    timings_ms: dict[str, float | None] = field(default_factory=dict)
    in_flight: dict[str, int] = field(default_factory=dict)
    ejected: bool = False
    # The longest gap between two events of each stream that was on the unit at the
    # fault and ended whole: the pause its client saw at the seam.
    seam_gaps_ms: list[float] = field(default_factory=list)
    other_gaps_ms: list[float] = field(default_factory=list)  # streams on the other units


def inject(unit: UnitProcs, child: Child | None, sig: signal.Signals, what: str) -> Fault:
    assert child is not None
    fault = Fault(unit.id, what, time.monotonic(), time.time())
    child.signal(sig)
    return fault


async def rolling_restart(
    http: aiohttp.ClientSession, cell: Cell, observer: Observer, routable: bool
) -> list[Fault]:
    faults = []
    for unit in cell.units:
        assert unit.sidecar is not None
        old = unit.sidecar
        fault = inject(unit, old, signal.SIGTERM, "SIGTERM sidecar (drain), restart")
        fault.exit_code = await old.wait()
        fault.drain_s = time.monotonic() - fault.at
        restarted = fault.down_until = time.monotonic()
        await cell.start_sidecar(http, unit)
        fault.ready_s = time.monotonic() - restarted
        fault.serving_again_s = await observer.until(unit.id, False) - restarted
        if routable:
            fault.routable_again_s = await observer.until(unit.id, True) - restarted
        fault.ended = time.monotonic()
        faults.append(fault)
    return faults


async def fail_one(cell: Cell, scenario: str, watch_s: float) -> list[Fault]:
    unit = cell.units[0]
    child, sig, what = {
        "follower-kill": (unit.follower, signal.SIGKILL, "SIGKILL follower"),
        "follower-stop": (unit.follower, signal.SIGSTOP, "SIGSTOP follower"),
        "sidecar-kill": (unit.sidecar, signal.SIGKILL, "SIGKILL sidecar"),
    }[scenario]
    fault = inject(unit, child, sig, what)
    await asyncio.sleep(watch_s)
    fault.ended = fault.down_until = time.monotonic()
    return [fault]


SCENARIOS = ("follower-kill", "follower-stop", "sidecar-kill", "rolling-restart",
             "rolling-restart-serving")  # fmt: skip


async def run_fault(
    name: str, http: aiohttp.ClientSession, cell: Cell, observer: Observer, watch_s: float
) -> list[Fault]:
    if name == "rolling-restart":
        return await rolling_restart(http, cell, observer, routable=True)
    if name == "rolling-restart-serving":
        return await rolling_restart(http, cell, observer, routable=False)
    return await fail_one(cell, name, watch_s)


TIMINGS = ("away_log", "away_poll", "last_routed")


def measure(fault: Fault, observer: Observer, results: list[Result], log: Path) -> None:
    def ms(t: float | None) -> float | None:
        return None if t is None else round((t - fault.at) * 1000, 1)

    logged = next(
        ((at, why) for at, unit, why in gateway_away_lines(log)
         if unit == fault.unit and at >= fault.wall - 0.01),
        None,
    )  # fmt: skip
    answered = [
        r.started
        for r in results
        if r.unit == fault.unit and fault.at <= r.started <= fault.down_until
    ]
    fault.timings_ms = {
        "away_log": None if logged is None else round((logged[0] - fault.wall) * 1000, 1),
        "away_poll": ms(observer.first_away(fault.unit, fault.at)),
        "last_routed": ms(observer.last_routed(fault.unit, fault.at, fault.down_until)),
        "last_started": ms(max(answered)) if answered else None,
    }
    on_unit = [r for r in results if r.unit == fault.unit and r.started < fault.at < r.ended]
    fault.in_flight = dict(Counter(r.kind for r in on_unit))
    fault.seam_gaps_ms = [round(r.max_gap_s * 1000, 1) for r in on_unit if r.kind == "ok"]
    # The same gap in the streams on the other units at that moment: what this machine's
    # own jitter is, without any failure.
    elsewhere = [r for r in results if r.unit != fault.unit and r.started < fault.at < r.ended]
    fault.other_gaps_ms = [round(r.max_gap_s * 1000, 1) for r in elsewhere if r.kind == "ok"]
    fault.ejected = observer.ejected_during(fault.unit, fault.at, fault.ended)
    fault.away_because = "" if logged is None else logged[1]


# -- one repetition -------------------------------------------------------------------


@dataclass(slots=True)
class Repetition:
    scenario: str
    index: int
    error: str = ""
    outcomes: dict[str, int] = field(default_factory=dict)
    faults: list[Fault] = field(default_factory=list)
    gateway_retries: dict[str, float] = field(default_factory=dict)
    gateway_migrations: dict[str, float] = field(default_factory=dict)
    # the gateway's migration_pause_seconds: cumulative counts by bucket bound (s)
    gateway_pause: dict[str, float] = field(default_factory=dict)
    checks: dict[str, int] = field(default_factory=dict)  # against the reference
    # Every line where the gateway stopped routing to a unit, faulty or not:
    # (ms after the first fault, unit, why).
    gateway_events: list[tuple[float, str, str]] = field(default_factory=list)


async def gateway_counters(http: aiohttp.ClientSession, url: str, family: str) -> dict[str, float]:
    """A labelled family of the gateway's /metrics: label value (or bucket bound) -> value."""
    async with http.get(f"{url}/metrics") as resp:
        lines = (await resp.text()).splitlines()
    found = {}
    for line in lines:
        if line.startswith(family + "{"):
            label = line.split('="', 1)[1].split('"')[0]
            found[label] = float(line.rsplit(" ", 1)[1])
    return found


async def reference_url(http: aiohttp.ClientSession, stack: AsyncExitStack, workdir: Path) -> str:
    """A sidecar that never fails, with the cell's simulator seed and no step time."""
    port, grpc_port = free_ports(2)
    args = ["sidecar", "--host", HOST, "--http-port", str(port), "--grpc-port", str(grpc_port),
            "--unit-id", "reference", "--capacity", "256", "--sim-decode-step-ms", "0",
            "--sim-max-num-seqs", "256"]  # fmt: skip
    child = await stack.enter_async_context(running("reference", args, workdir / "ref.log"))
    child.http_url = f"http://{HOST}:{port}"
    await child.until_ready(START_TIMEOUT_S)
    return child.http_url


async def repetition(settings: BenchSettings, name: str, index: int, workdir: Path) -> Repetition:
    rep = Repetition(name, index)
    tag = workdir / f"{name}-{index}"
    tag.mkdir()
    async with AsyncExitStack() as stack:
        http = await stack.enter_async_context(aiohttp.ClientSession())
        try:
            cell = await start_cell(http, settings.units, tag, stack, settings.step_ms)
            observer = Observer(http, cell.gateway_url)
            stack.push_async_callback(observer.close)
            load = Load(http, cell.gateway_url, settings.clients, settings.tokens)
            await asyncio.sleep(settings.settle_s)
            rep.faults = await run_fault(name, http, cell, observer, settings.watch_s)
            await asyncio.sleep(settings.settle_s)
            results = await load.stop()
            for fault in rep.faults:
                measure(fault, observer, results, cell.gateway.log_path)
            rep.outcomes = dict(Counter(r.kind for r in results))
            await check_references(http, await reference_url(http, stack, tag), results)
            rep.checks = dict(Counter(r.check for r in results if r.check))
            first = rep.faults[0].wall
            rep.gateway_events = [(round((at - first) * 1000, 1), unit, why)
                                  for at, unit, why in gateway_away_lines(cell.gateway.log_path)]  # fmt: skip
            rep.gateway_retries = await gateway_counters(
                http, cell.gateway_url, "unitproxy_retries_total"
            )
            rep.gateway_migrations = await gateway_counters(
                http, cell.gateway_url, "unitproxy_migrations_total"
            )
            rep.gateway_pause = await gateway_counters(
                http, cell.gateway_url, "unitproxy_migration_pause_seconds_bucket"
            )
        except (ChildFailed, TimeoutError) as exc:
            rep.error = str(exc) or type(exc).__name__
    return rep


# -- results --------------------------------------------------------------------------


def lost(outcomes: dict[str, int]) -> int:
    return sum(n for kind, n in outcomes.items() if kind != "ok")


def stats(values: Sequence[float | None], missing: str = "-", digits: int = 0) -> str:
    """min / p50 / max of the known values; ``missing`` counts the unknown ones."""
    known = [v for v in values if v is not None]
    absent = len(values) - len(known)
    if not known:
        return missing if values else "-"
    text = " / ".join(f"{v:.{digits}f}" for v in (min(known), statistics.median(known), max(known)))
    return text if not absent else f"{text} ({absent} {missing})"


def percentile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def bucket_p99(reps: list[Repetition]) -> str:
    """The gateway's migration_pause_seconds p99, as the bucket bound it falls under."""
    total = Counter[str]()
    for r in reps:
        total.update(r.gateway_pause)
    count = total.get("+Inf", 0)
    if not count:
        return "-"
    bounds = sorted((float(b), n) for b, n in total.items() if b != "+Inf")
    bound = next((b for b, n in bounds if n >= 0.99 * count), None)
    return f"<={bound * 1000:g}" if bound is not None else ">max"


def seam(reps: list[Repetition]) -> list[float]:
    return [g for r in reps for f in r.faults for g in f.seam_gaps_ms]


def others(reps: list[Repetition]) -> list[float]:
    return [g for r in reps for f in r.faults for g in f.other_gaps_ms]


def scenario_rows(reps: list[Repetition]) -> list[tuple[str, ...]]:
    rows = []
    for name in dict.fromkeys(r.scenario for r in reps):
        mine = [r for r in reps if r.scenario == name]
        faults = [f for r in mine for f in r.faults]
        total = Counter[str]()
        checks = Counter[str]()
        migrated = 0.0
        for r in mine:
            total.update(r.outcomes)
            checks.update(r.checks)
            migrated += sum(r.gateway_migrations.values())
        gaps = seam(mine)
        p50, p99 = percentile(gaps, 0.5), percentile(gaps, 0.99)
        base = percentile(others(mine), 0.99)
        times = [stats([f.timings_ms.get(key) for f in faults], "none" if "last" in key else "-")
                 for key in TIMINGS]  # fmt: skip
        rows.append((
            name, str(len(faults)), str(sum(total.values())), str(lost(total)),
            str(sum(n for k, n in checks.items() if k != "same")), f"{migrated:g}",
            "-" if p50 is None else f"{p50:.0f} / {p99:.0f} ({len(gaps)})",
            "-" if base is None else f"{base:.0f}",
            bucket_p99(mine), *times, f"{sum(f.ejected for f in faults)}/{len(faults)}",
        ))  # fmt: skip
    return rows


def table(reps: list[Repetition]) -> str:
    head = ("scenario", "faults", "streams", "errors", "differ", "migrated",
            "seam p50/p99 ms (n)", "others p99 ms", "gw pause p99 ms", "away log ms", "away poll ms",
            "last routed ms", "ejected")  # fmt: skip
    rows = [head, *scenario_rows(reps)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in
                       enumerate(zip(row, widths, strict=True))) for row in rows]  # fmt: skip
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


# Goal for the pause at the seam (p99, ms) by scenario; for a hung follower the unit is
# found out by its health checks (interval 1 s x 3 failures, 1 s timeout): the goal is
# that detection plus 250 ms.
SEAM_GOAL_MS = {"follower-kill": 250.0, "sidecar-kill": 250.0, "follower-stop": 4250.0}


def goals(reps: list[Repetition]) -> list[str]:
    lines = []
    for name in dict.fromkeys(r.scenario for r in reps):
        mine = [r for r in reps if r.scenario == name]
        outcomes, checks = Counter[str](), Counter[str]()
        for r in mine:
            outcomes.update(r.outcomes)
            checks.update(r.checks)
        errors, differ = lost(outcomes), sum(n for k, n in checks.items() if k != "same")
        verdicts = [f"0 client errors: {'MET' if not errors else f'MISSED ({errors})'}",
                    f"every text and usage as the reference: "
                    f"{'MET' if not differ else f'MISSED ({differ})'}"]  # fmt: skip
        goal = SEAM_GOAL_MS.get(name)
        p99 = percentile(seam(mine), 0.99)
        base = percentile(others(mine), 0.99) or 0.0
        if goal is not None and p99 is not None:
            verdict = "MET" if p99 <= goal else "MISSED"
            verdicts.append(
                f"seam p99 {p99:.0f} ms <= {goal:g} ms: {verdict} (streams on the other "
                f"units, no failure: p99 {base:.0f} ms; the excess {p99 - base:+.0f} ms)"
            )
        lines.append(f"  {name}: " + "; ".join(verdicts))
    return lines


def plot(reps: list[Repetition], path: Path) -> bool:
    """The seam pauses by scenario, each stream a dot, the goals as lines."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    names = [n for n in dict.fromkeys(r.scenario for r in reps)]
    fig, ax = plt.subplots(figsize=(8, 4))
    for i, name in enumerate(names):
        mine = [r for r in reps if r.scenario == name]
        gaps, base = seam(mine), others(mine)
        ax.scatter([i - 0.1] * len(gaps), gaps, s=10, alpha=0.6, color="tab:blue",
                   label="on the failing unit" if i == 0 else None)  # fmt: skip
        ax.scatter([i + 0.1] * len(base), base, s=6, alpha=0.4, color="tab:gray",
                   label="on the other units" if i == 0 else None)  # fmt: skip
        if name in SEAM_GOAL_MS:
            ax.hlines(SEAM_GOAL_MS[name], i - 0.3, i + 0.3, colors="red", linestyles="dashed")
    ax.set_xticks(range(len(names)), names, rotation=15)
    ax.set_yscale("log")
    ax.set_ylim(bottom=5, top=max(SEAM_GOAL_MS.values()) * 1.5)
    ax.set_ylabel("longest gap between two events, ms")
    ax.set_title(
        "Streams in flight at the fault: the longest pause their clients saw (goal dashed)"
    )
    ax.legend(loc="upper right", fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def notes(reps: list[Repetition]) -> list[str]:
    lines = []
    for name in dict.fromkeys(r.scenario for r in reps):
        mine = [r for r in reps if r.scenario == name]
        errors = Counter[str]()
        for r in mine:
            errors.update({k: n for k, n in r.outcomes.items() if k != "ok"})
        seen = ", ".join(f"{k}: {n}" for k, n in errors.most_common()) or "none"
        lines.append(f"  {name}: errors seen by clients: {seen}")
        why = Counter(f.away_because for r in mine for f in r.faults)
        lines.append(f"      the gateway's log, routing away: {dict(why)}")
        in_flight = Counter[str]()
        for f in (f for r in mine for f in r.faults):
            in_flight.update(f.in_flight)
        lines.append(f"      streams in flight on the faulty unit at the fault: {dict(in_flight)}")
        drains = [f.drain_s for r in mine for f in r.faults if f.drain_s is not None]
        if drains:
            ready = [f.ready_s for r in mine for f in r.faults]
            back = [f.serving_again_s for r in mine for f in r.faults]
            routable = [f.routable_again_s for r in mine for f in r.faults]
            codes = sorted({f.exit_code for r in mine for f in r.faults if f.exit_code is not None})
            lines.append(
                f"      drain (SIGTERM -> exit) s: {stats(drains, digits=2)} "
                f"min/p50/max, exit codes {codes}"
            )
            lines.append(f"      restart -> sidecar ready s: {stats(ready, digits=2)}; -> SERVING "
                         f"at gateway s: {stats(back, digits=2)}; -> routable s: "
                         f"{stats(routable, digits=2)}")  # fmt: skip
        retried = Counter[str]()
        for r in mine:
            retried.update(r.gateway_retries)
        lines.append(f"      gateway retries by reason: {dict(retried) or 'none'}")
        migrated = Counter[str]()
        checks = Counter[str]()
        for r in mine:
            migrated.update(r.gateway_migrations)
            checks.update(r.checks)
        lines.append(f"      gateway migrations by reason: {dict(migrated) or 'none'}")
        lines.append(f"      streams against their reference: {dict(checks) or 'none'}")
        lines += [f"      !!! repetition {r.index}: {r.error}" for r in mine if r.error]
        for r in mine:
            faulty = {f.unit for f in r.faults}
            lines += [f"      !!! repetition {r.index}: the gateway also stopped routing to "
                      f"{unit} at {ms:+.0f} ms: {why}"
                      for ms, unit, why in r.gateway_events
                      if unit not in faulty and ms >= 0]  # fmt: skip
    return lines


def machine_info() -> dict[str, Any]:
    return {
        "nproc": len(os.sched_getaffinity(0)),
        "cpu_model": cpu_model(),
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "platform": platform.platform(),
        "loop": loop_name(),
        "aiohttp": aiohttp.__version__,
    }


# -- main -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class BenchSettings:
    scenarios: tuple[str, ...]
    repeat: int
    units: int
    clients: int
    tokens: int
    settle_s: float
    watch_s: float
    out: Path
    keep_logs: bool
    step_ms: float = 10.0


async def run_all(settings: BenchSettings, workdir: Path) -> list[Repetition]:
    reps = []
    for name in settings.scenarios:
        for index in range(settings.repeat):
            rep = await repetition(settings, name, index, workdir)
            shown = rep.error or f"{sum(rep.outcomes.values())} requests, {lost(rep.outcomes)} lost"
            print(f"  {name} #{index}: {shown}", file=sys.stderr, flush=True)
            reps.append(rep)
    return reps


def parse_settings(argv: Sequence[str] | None) -> BenchSettings:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--scenarios", default=",".join(SCENARIOS),
                        help=f"comma-separated, of {','.join(SCENARIOS)} (all)")  # fmt: skip
    parser.add_argument("--repeat", type=int, default=3, help="fresh cells per scenario (3)")
    parser.add_argument("--quick", action="store_true",
                        help="1 repetition, 16 clients of 64 tokens, 1 s settle")  # fmt: skip
    parser.add_argument("--units", type=int, default=3, help="units in the cell (3)")
    parser.add_argument("--clients", type=int, default=64, help="streaming clients (64)")
    parser.add_argument("--tokens", type=int, default=512,
                        help="tokens a stream (512)")  # fmt: skip
    parser.add_argument("--step-ms", type=float, default=10.0,
                        help="the simulator's decode step, ms a token (10: 512 tokens in "
                             "5 s; 64 streams are then 6,400 events/s for client, gateway "
                             "and units to share on this machine)")  # fmt: skip
    parser.add_argument("--settle", type=float, default=2.0, help="load before and after (2 s)")
    parser.add_argument("--watch", type=float, default=6.0,
                        help="after a kill or stop (6 s: a stopped node is found out in ~4)")  # fmt: skip
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"JSON ({DEFAULT_OUT})")
    parser.add_argument("--keep-logs", action="store_true", help="keep child logs even if all ok")
    args = parser.parse_args(argv)
    names = tuple(n.strip() for n in args.scenarios.split(",") if n.strip())
    if not names or set(names) - set(SCENARIOS):
        parser.error(f"--scenarios: unknown {sorted(set(names) - set(SCENARIOS))}")
    if args.units < 2:
        parser.error("--units must be at least 2: failover needs somewhere to go")
    if args.quick:
        args.repeat, args.clients, args.tokens, args.settle = 1, 16, 64, 1.0
    return BenchSettings(names, args.repeat, args.units, args.clients, args.tokens,
                         args.settle, args.watch, args.out, args.keep_logs, args.step_ms)  # fmt: skip


def fault_json(fault: Fault) -> dict[str, Any]:
    found = asdict(fault)
    for key in ("at", "ended", "down_until"):
        found.pop(key)
    return found


def main(argv: Sequence[str] | None = None) -> int:
    settings = parse_settings(argv)
    workdir = Path(tempfile.mkdtemp(prefix="failover-under-load-"))
    started = time.monotonic()
    try:
        reps = run_loop(until_signal(run_all(settings, workdir)))
    except (KeyboardInterrupt, Interrupted):
        print(f"interrupted; every child was stopped; logs in {workdir}", file=sys.stderr)
        return 130
    failed = any(r.error for r in reps)
    logs = str(workdir)
    if not failed and not any(lost(r.outcomes) for r in reps) and not settings.keep_logs:
        shutil.rmtree(workdir, ignore_errors=True)
        logs += " (removed: every repetition ran, no request lost; --keep-logs keeps them)"
    report: dict[str, Any] = {
        "benchmark": "failover_under_load",
        "finished_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": shlex.join([sys.executable, *sys.argv]),
        "settings": {**asdict(settings), "out": str(settings.out)},
        "machine": machine_info(),
        "duration_s": round(time.monotonic() - started, 1),
        "logs": logs,
        "table": table(reps).splitlines(),
        "goals": goals(reps),
        "repetitions": [
            {**asdict(r), "lost": lost(r.outcomes), "faults": [fault_json(f) for f in r.faults]}
            for r in reps
        ],
    }
    settings.out.parent.mkdir(parents=True, exist_ok=True)
    settings.out.write_text(json.dumps(report, indent=2) + "\n")
    m = report["machine"]
    print(f"command: {report['command']}")
    print(f"machine: nproc {m['nproc']}, {m['cpu_model']}, {m['python']}, loop {m['loop']}")
    print(f"{settings.units} units, {settings.clients} streaming clients of {settings.tokens} "
          f"tokens, {settings.repeat} repetitions; {report['duration_s']:g} s in all\n")  # fmt: skip
    print(table(reps))
    print("errors: streams that did not end whole; differ: streams whose text or usage is "
          "not the reference's; migrated: the gateway's migrations_total; seam: the longest "
          "gap in each stream that was on the faulty unit at the fault; others: the same in "
          "the streams on the other units at that moment (this machine's jitter); gw pause: "
          "the gateway's migration_pause_seconds (failure seen -> next unit's first byte); away and routed "
          "times from just before os.kill, min / p50 / max over faults ('none': no request "
          "was routed to the unit after it); ejected: faults after which passive health "
          "ejected the unit")  # fmt: skip
    print("\n".join(notes(reps)))
    print("goals:\n" + "\n".join(goals(reps)))
    png = settings.out.with_suffix(".png")
    if plot(reps, png):
        print(f"PNG: {png}")
    print(f"\nlogs: {logs}\nJSON: {settings.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
