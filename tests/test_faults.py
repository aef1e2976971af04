"""The fault matrix with real processes on loopback: what clients see when a unit fails.

Each test starts its own followers, sidecars and gateway (``tests.procs``), puts load
on them, injects one fault and counts what every request ended as. Each prints one
``FAULT`` line with those counts (``pytest -s`` shows them); the assertions hold the
product to docs/api.md (Semantics): nothing hangs past its deadline, a stream cut short says so with
an SSE error event, new work goes elsewhere, every count returns to 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import socket
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest

from proxy.httputil import DEADLINE_HEADER, UNIT_HEADER
from proxy.pb.unitproxy.v1 import inference_pb2, inference_pb2_grpc
from tests.conftest import GatewayFactory, SidecarFactory, wait_until
from tests.procs import HOST, BlackHole, Proc, Procs, free_ports

pytestmark = [pytest.mark.timeout(90), pytest.mark.slow]

SIM = ("--sim-decode-step-ms", "5", "--sim-decode-ms-per-seq", "0",
       "--sim-prefill-ms-per-token", "0")  # fmt: skip
# A SIGSTOPped follower is caught only by its Check timing out: make that quick, but
# not so quick that a busy CI machine makes a healthy follower look hung.
FAST_HEALTH = ("--health-interval", "0.1", "--health-timeout", "0.5",
               "--unhealthy-threshold", "3", "--healthy-threshold", "2")  # fmt: skip
DEADLINE_MS = 10_000
HANG_SLACK_S = 3.0  # a request still open this long past its deadline hangs


# -- one request, classified ----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Result:
    kind: str  # "ok", "sse_error <type>", "status <code>", "cut", "hang"
    unit: str | None
    started: float  # time.monotonic() before the request was sent
    ended: float
    tokens: int = 0


def classify(events: list[bytes], tokens: int) -> tuple[str, int]:
    """What a finished SSE body amounts to, and its number of token events."""
    if events and events[-1] == b"data: [DONE]\n":
        got = len(events) - 1
        return ("ok" if got == tokens else f"short {got}/{tokens}"), got
    if events:
        last = json.loads(events[-1][6:])
        if "error" in last:
            return f"sse_error {last['error']['type']}", len(events) - 1
    return "cut", len(events)


async def stream(
    http: aiohttp.ClientSession, url: str, tokens: int, deadline_ms: int = DEADLINE_MS
) -> Result:
    """One streaming completion with a deadline; never waits past it by more than slack."""
    body = {"prompt": "x", "max_tokens": tokens, "stream": True}
    started, unit, kind, got = time.monotonic(), None, "hang", 0
    try:
        async with asyncio.timeout(deadline_ms / 1000 + HANG_SLACK_S):
            headers = {DEADLINE_HEADER: str(deadline_ms)}
            async with http.post(f"{url}/v1/completions", json=body, headers=headers) as resp:
                unit = resp.headers.get(UNIT_HEADER)
                if resp.status != 200:
                    kind = f"status {resp.status}"
                else:
                    events = [line async for line in resp.content if line.startswith(b"data: ")]
                    kind, got = classify(events, tokens)
    except TimeoutError:
        pass
    except aiohttp.ClientError:
        kind = "cut"
    return Result(kind, unit, started, time.monotonic(), got)


class Load:
    """``clients`` loops of back-to-back streams until ``stop``; keeps every result."""

    def __init__(self, http: aiohttp.ClientSession, url: str, clients: int, tokens: int):
        self.results: list[Result] = []
        self._stop = asyncio.Event()
        self._tasks = [asyncio.create_task(self._client(http, url, tokens)) for _ in range(clients)]

    async def _client(self, http: aiohttp.ClientSession, url: str, tokens: int) -> None:
        while not self._stop.is_set():
            self.results.append(await stream(http, url, tokens))

    async def stop(self) -> list[Result]:
        self._stop.set()
        async with asyncio.timeout(DEADLINE_MS / 1000 + HANG_SLACK_S + 2):
            await asyncio.gather(*self._tasks)
        return self.results


# -- a cell of units behind a gateway -------------------------------------------------


@dataclass(slots=True)
class Cell:
    gateway: Proc
    sidecars: list[Proc]
    followers: list[Proc] = field(default_factory=list)


def unit_flag(unit_id: str, http_url: str, grpc_target: str) -> tuple[str, str]:
    return "--unit", f"{unit_id}={http_url},{grpc_target}"


async def start_cell(procs: Procs, units: int, *sidecar_args: str, followers: bool = True) -> Cell:
    """``units`` units (a follower each, unless told not) behind one gateway process."""
    ports = free_ports(2 * units + 2)
    cell_followers: list[Proc] = []
    sidecars: list[Proc] = []
    flags: list[str] = []
    for i in range(units):
        args = ["--unit-id", f"u{i}", *SIM, *sidecar_args]
        if followers:
            follower = await procs.follower("--node-name", f"u{i}-f1")
            cell_followers.append(follower)
            args += ["--follower", f"u{i}-f1={follower.grpc_target}"]
        sidecar = await procs.sidecar(ports[2 * i], ports[2 * i + 1], *args)
        sidecars.append(sidecar)
        flags += unit_flag(f"u{i}", sidecar.http_url, sidecar.grpc_target)
    gateway = await procs.gateway(ports[-2], ports[-1], *flags)
    cell = Cell(gateway, sidecars, cell_followers)
    async with aiohttp.ClientSession() as http:
        for i in range(units):
            await gateway_sees(http, gateway, f"u{i}", "SERVING")
    return cell


async def get_json(http: aiohttp.ClientSession, url: str) -> Any:
    async with http.get(url) as resp:
        return await resp.json()


async def gateway_units(http: aiohttp.ClientSession, gateway: Proc) -> dict[str, Any]:
    return {u["id"]: u for u in (await get_json(http, f"{gateway.http_url}/units"))["units"]}


async def gateway_sees(
    http: aiohttp.ClientSession,
    gateway: Proc,
    unit: str,
    state: str,
    timeout_s: float = 15,
    routable: bool = False,
) -> float:
    """Poll the gateway's /units every 10 ms; the monotonic time it first shows ``state``
    (and, if ``routable``, the unit not ejected by passive health either)."""

    def shows(u: dict[str, Any]) -> bool:
        return u["state"] == state and not (routable and u["ejected_for_s"] > 0)

    async with asyncio.timeout(timeout_s):
        while not shows((await gateway_units(http, gateway))[unit]):
            await asyncio.sleep(0.01)
    return time.monotonic()


async def retries(http: aiohttp.ClientSession, gateway: Proc) -> dict[str, float]:
    """The gateway's retries so far, by reason."""
    async with http.get(f"{gateway.http_url}/metrics") as resp:
        lines = (await resp.text()).splitlines()
    found = {}
    for line in lines:
        if line.startswith("unitproxy_retries_total{"):
            reason = line.split('reason="', 1)[1].split('"', 1)[0]
            found[reason] = float(line.rsplit(" ", 1)[1])
    return found


async def until(check: Callable[[], Awaitable[bool]], what: str, timeout_s: float = 10) -> None:
    try:
        async with asyncio.timeout(timeout_s):
            while not await check():
                await asyncio.sleep(0.05)
    except TimeoutError:
        pytest.fail(f"timed out after {timeout_s} s waiting for {what}")


async def all_settled(http: aiohttp.ClientSession, cell: Cell) -> dict[str, Any]:
    """Wait until nothing is outstanding anywhere; return what each process says."""
    seen: dict[str, Any] = {}

    async def settled() -> bool:
        for sidecar in cell.sidecars:
            seen[sidecar.http_url] = await get_json(http, f"{sidecar.http_url}/load")
        seen["gateway"] = await get_json(http, f"{cell.gateway.http_url}/units")
        seen["gateway_ready"] = await get_json(http, f"{cell.gateway.http_url}/ready")
        loads = [seen[s.http_url] for s in cell.sidecars]
        return (
            all(load["outstanding"] == load["running"] == load["waiting"] == 0 for load in loads)
            and all(u["inflight_here"] == 0 for u in seen["gateway"]["units"])
            and seen["gateway"]["waiting"] == 0
            and seen["gateway_ready"]["in_flight"] == 0
        )

    await until(settled, f"every count back to 0 ({seen})")
    return seen


def report(fault: str, **counts: Any) -> None:
    print(f"\nFAULT {fault}: {json.dumps(counts, sort_keys=True, default=str)}")


def kinds(results: list[Result]) -> Counter[str]:
    return Counter(r.kind for r in results)


def odd(results: list[Result], fault_at: float) -> list[tuple[str, str | None, int, int]]:
    """Each request that did not end whole: kind, unit, start and end in ms after the fault."""
    return [
        (r.kind, r.unit, round((r.started - fault_at) * 1000), round((r.ended - fault_at) * 1000))
        for r in results
        if r.kind != "ok"
    ]


def no_hangs(results: list[Result]) -> None:
    budget = DEADLINE_MS / 1000 + HANG_SLACK_S
    assert all(r.kind != "hang" and r.ended - r.started < budget for r in results), kinds(results)


# -- follower faults under load -------------------------------------------------------


async def test_follower_sigkill_under_load(procs: Procs) -> None:
    cell = await start_cell(procs, 2)
    async with aiohttp.ClientSession() as http:
        load = Load(http, cell.gateway.http_url, clients=8, tokens=60)  # ~0.3 s a stream
        await asyncio.sleep(1.0)
        killed_at = time.monotonic()
        cell.followers[0].signal(signal.SIGKILL)
        seen_at = await gateway_sees(http, cell.gateway, "u0", "NOT_SERVING", 5)
        await asyncio.sleep(1.5)
        results = await load.stop()
        retried = await retries(http, cell.gateway)
        await all_settled(http, cell)
    in_flight = [r for r in results if r.unit == "u0" and r.started < killed_at < r.ended]
    after = [r for r in results if r.started > seen_at]
    report(
        "follower SIGKILL",
        requests=len(results),
        outcomes=kinds(results),
        not_whole=odd(results, killed_at),
        in_flight_on_faulty_unit=kinds(in_flight),
        started_after_not_serving=Counter(r.unit or "no unit header" for r in after),
        not_serving_seen_ms=round((seen_at - killed_at) * 1000),
        gateway_retries=retried,
    )
    assert in_flight, "streams were in flight on the unit when its follower died"
    assert all(r.kind == "ok" or r.kind.startswith("sse_error") for r in results), kinds(results)
    no_hangs(results)
    assert len(after) > 10 and {r.unit for r in after} == {"u1"}, "new work went elsewhere"


async def test_follower_sigstop_under_load_then_sigcont(procs: Procs) -> None:
    cell = await start_cell(procs, 2, *FAST_HEALTH)
    async with aiohttp.ClientSession() as http:
        load = Load(http, cell.gateway.http_url, clients=8, tokens=60)
        await asyncio.sleep(1.0)
        stopped_at = time.monotonic()
        cell.followers[0].signal(signal.SIGSTOP)
        seen_at = await gateway_sees(http, cell.gateway, "u0", "NOT_SERVING", 5)
        await asyncio.sleep(1.0)
        cont_at = time.monotonic()
        cell.followers[0].signal(signal.SIGCONT)
        serving_at = await gateway_sees(http, cell.gateway, "u0", "SERVING", 5)
        # 503s from u0 before the gateway knew may have ejected it (eject_s, 5 s).
        back_at = await gateway_sees(http, cell.gateway, "u0", "SERVING", 10, routable=True)
        await asyncio.sleep(1.5)
        results = await load.stop()
        retried = await retries(http, cell.gateway)
        await all_settled(http, cell)
    in_flight = [r for r in results if r.unit == "u0" and r.started < stopped_at < r.ended]
    # A request is routed a little after it starts: leave the last 0.2 s out.
    away = [r for r in results if seen_at < r.started < cont_at - 0.2]
    back = [r for r in results if r.started > back_at]
    report(
        "follower SIGSTOP, then SIGCONT",
        requests=len(results),
        outcomes=kinds(results),
        not_whole=odd(results, stopped_at),
        in_flight_on_faulty_unit=kinds(in_flight),
        started_while_not_serving=Counter(r.unit or "no unit header" for r in away),
        started_after_routable_again=Counter(r.unit or "no unit header" for r in back),
        not_serving_seen_ms=round((seen_at - stopped_at) * 1000),
        serving_again_after_sigcont_ms=round((serving_at - cont_at) * 1000),
        routable_again_after_sigcont_ms=round((back_at - cont_at) * 1000),
        gateway_retries=retried,
    )
    assert all(r.kind == "ok" or r.kind.startswith("sse_error") for r in results), kinds(results)
    no_hangs(results)
    assert away and {r.unit for r in away} == {"u1"}, "new work went elsewhere while stopped"
    assert any(r.unit == "u0" and r.kind == "ok" for r in back), "the unit serves again"


# -- engine error mid-stream ----------------------------------------------------------


async def test_engine_error_mid_stream(procs: Procs) -> None:
    cell = await start_cell(procs, 1, "--sim-error-after-tokens", "5", followers=False)
    sidecar = cell.sidecars[0]
    async with aiohttp.ClientSession() as http:
        urls = [cell.gateway.http_url] * 16 + [sidecar.http_url] * 4
        results = await asyncio.gather(*(stream(http, url, 20) for url in urls))
        settled = await all_settled(http, cell)
    report(
        "engine error mid-stream",
        outcomes=kinds(results),
        tokens_before_error=Counter(r.tokens for r in results),
        unit_ejected_for_s=settled["gateway"]["units"][0]["ejected_for_s"],
    )
    assert kinds(results) == Counter({"sse_error engine_error": 20})
    assert {r.tokens for r in results} == {5}, "the tokens made before the error got through"


# -- a unit whose ports accept connections and never answer ---------------------------


async def test_black_hole_closes_every_connection_when_it_closes() -> None:
    # Clients connect up to the moment it closes: the last ones are accepted by the
    # loop and not yet handled when close() runs. Each must still be closed by the
    # hole's end, or it outlives the test (and its event loop) as an open socket.
    hole = BlackHole()
    host, port = (await hole.start()).rsplit(":", 1)
    loop = asyncio.get_running_loop()
    clients: list[socket.socket] = []
    try:
        for _ in range(20):
            client = socket.socket()
            clients.append(client)
            client.setblocking(False)
            await loop.sock_connect(client, (host, int(port)))
    finally:
        await hole.close()
    try:
        for client in clients:
            async with asyncio.timeout(5):
                with contextlib.suppress(ConnectionResetError):
                    assert await loop.sock_recv(client, 1) == b"", "it never writes"
    finally:
        for client in clients:
            client.close()
    assert 1 <= hole.accepted <= 20


async def timed_post(
    http: aiohttp.ClientSession, url: str, body: dict[str, Any], headers: dict[str, str]
) -> tuple[int, float]:
    started = time.monotonic()
    async with http.post(f"{url}/v1/completions", json=body, headers=headers) as resp:
        await resp.read()
        return resp.status, time.monotonic() - started


@pytest.mark.parametrize("load_source", ["watch-http", "watch"])
async def test_black_hole_unit_gets_no_work(procs: Procs, load_source: str) -> None:
    hole_http, hole_grpc = BlackHole(), BlackHole()
    try:
        http_target, grpc_target = await hole_http.start(), await hole_grpc.start()
        sc_http, sc_grpc, gw_http, gw_grpc = free_ports(4)
        good = await procs.sidecar(sc_http, sc_grpc, "--unit-id", "good", *SIM)
        gateway = await procs.gateway(
            gw_http, gw_grpc, "--load-source", load_source,
            *unit_flag("good", good.http_url, good.grpc_target),
            *unit_flag("hole", f"http://{http_target}", grpc_target),
        )  # fmt: skip
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as http:
            bodies = [{"prompt": "x", "max_tokens": 5, "stream": i % 2 == 0} for i in range(40)]
            headers = {DEADLINE_HEADER: "5000"}
            results = await asyncio.gather(
                *(timed_post(http, gateway.http_url, b, headers) for b in bodies)
            )
            units = await gateway_units(http, gateway)
            ready = await get_json(http, f"{gateway.http_url}/ready")
    finally:
        await hole_http.close()
        await hole_grpc.close()
    report(
        f"unit that accepts and never answers (both ports; load from {load_source})",
        statuses=Counter(status for status, _ in results),
        routed=Counter({u: units[u]["routed"] for u in units}),
        hole_state=units["hole"]["state"],
        grpc_connections_to_hole=hole_grpc.accepted,
        http_connections_to_hole=hole_http.accepted,
        gateway_ready=ready,
    )
    assert Counter(status for status, _ in results) == Counter({200: 40})
    assert units["hole"]["state"] == "UNKNOWN" and units["hole"]["routed"] == 0
    # The gateway did try to get its load reports, and sent no request there.
    if load_source == "watch":
        assert hole_grpc.accepted >= 1 and hole_http.accepted == 0
    else:
        assert hole_http.accepted >= 1 and hole_grpc.accepted == 0
    assert ready["state"] == "SERVING" and ready["serving_units"] == 1


async def test_hung_http_port_of_a_serving_unit_ends_at_the_deadline(procs: Procs) -> None:
    # The unit's gRPC load reports say SERVING (a real sidecar's), its HTTP port is a
    # black hole: a wedged HTTP server beside a live gRPC one. Requests sent there can
    # only end by their deadline.
    hole = BlackHole()
    try:
        hole_target = await hole.start()
        ports = free_ports(6)
        good = await procs.sidecar(ports[0], ports[1], "--unit-id", "good", *SIM)
        wedged = await procs.sidecar(ports[2], ports[3], "--unit-id", "wedged", *SIM)
        gateway = await procs.gateway(
            ports[4], ports[5], "--request-timeout", "2", "--load-source", "watch",
            *unit_flag("good", good.http_url, good.grpc_target),
            *unit_flag("wedged", f"http://{hole_target}", wedged.grpc_target),
        )  # fmt: skip
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as http:
            await gateway_sees(http, gateway, "wedged", "SERVING")
            body: dict[str, Any] = {"prompt": "x", "max_tokens": 5}
            with_deadline = [
                timed_post(http, gateway.http_url, {**body, "stream": i % 2 == 0},
                           {DEADLINE_HEADER: "1000"})
                for i in range(16)
            ]  # fmt: skip
            # No header: the gateway's --request-timeout (2 s) is the deadline.
            without = [timed_post(http, gateway.http_url, body, {}) for _ in range(4)]
            results = await asyncio.gather(*with_deadline, *without)
            units = await gateway_units(http, gateway)
    finally:
        await hole.close()
    statuses = Counter(status for status, _ in results)
    report(
        "serving unit whose HTTP port accepts and never answers",
        statuses=statuses,
        routed=Counter({u: units[u]["routed"] for u in units}),
        seconds_504_with_1s_deadline=sorted(round(t, 2) for s, t in results[:16] if s == 504),
        seconds_504_without_header=sorted(round(t, 2) for s, t in results[16:] if s == 504),
        wedged_ejected_for_s=units["wedged"]["ejected_for_s"],
        wedged_inflight_after=units["wedged"]["inflight_here"],
    )
    assert set(statuses) <= {200, 504} and statuses[504] >= 1, statuses
    assert statuses[504] == units["wedged"]["routed"], "every request sent there, and only those"
    for (status, seconds), limit in zip(results, [1.0] * 16 + [2.0] * 4, strict=True):
        # Without a deadline these would hang to the client's 20 s; 2 s of slack
        # covers a loaded machine's scheduling without hiding a missed deadline.
        assert seconds < limit + 2.0, "ended at its deadline, not later"
        if status == 504:
            assert seconds >= limit - 0.05
    assert units["wedged"]["inflight_here"] == 0


# -- clients that stop reading --------------------------------------------------------


def rss_mb(proc: Proc) -> float:
    for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {proc.pid}")


def open_fds(proc: Proc) -> int:
    return len(list(Path(f"/proc/{proc.pid}/fd").iterdir()))


async def unread_stream(port: int) -> socket.socket:
    """Send a streaming request with a tiny receive buffer, then never read a byte.

    A raw socket, not an asyncio transport: a transport would keep reading for us."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    await loop.sock_connect(sock, (HOST, port))
    body = json.dumps({"prompt": "x", "max_tokens": 100_000_000, "stream": True}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {HOST}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n")  # fmt: skip
    await loop.sock_sendall(sock, head.encode() + body)
    return sock


async def metric(http: aiohttp.ClientSession, proc: Proc, prefix: str) -> float:
    """The sum of the samples whose line starts with ``prefix`` on the process's /metrics."""
    async with http.get(f"{proc.http_url}/metrics") as resp:
        lines = (await resp.text()).splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(prefix))


async def consumed_tokens(http: aiohttp.ClientSession, sidecar: Proc) -> float:
    """Tokens the sidecar's core took from its engine (and handed to a writer)."""
    return await metric(http, sidecar, "unitproxy_generated_tokens_total ")


async def until_blocked(http: aiohttp.ClientSession, sidecar: Proc) -> float:
    """Wait until the sidecar stops taking tokens: every socket buffer on the way is full."""
    before = await consumed_tokens(http, sidecar)
    async with asyncio.timeout(30):
        while True:
            await asyncio.sleep(0.5)
            now = await consumed_tokens(http, sidecar)
            if now == before:
                return time.monotonic()
            before = now


def port_of(proc: Proc) -> int:
    return int(proc.http_url.rsplit(":", 1)[1])


async def test_clients_that_stop_reading(procs: Procs) -> None:
    # Decode as fast as the loop allows, so the socket buffers on the way fill in seconds.
    cell = await start_cell(
        procs, 1, "--sim-decode-step-ms", "0", "--stall-timeout", "1", *FAST_HEALTH,
        followers=False,
    )  # fmt: skip
    sidecar, gateway = cell.sidecars[0], cell.gateway
    rss_before = {"sidecar": rss_mb(sidecar), "gateway": rss_mb(gateway)}
    socks = [await unread_stream(port_of(gateway)) for _ in range(2)]
    socks += [await unread_stream(port_of(sidecar)) for _ in range(2)]
    try:
        async with aiohttp.ClientSession() as http:
            blocked_at = await until_blocked(http, sidecar)
            gateway_blocked = rss_mb(gateway)
            # Only unread streams outstanding, for longer than --stall-timeout: the
            # unit must stay SERVING (waiting on a client is no engine stall).
            states = set()
            while time.monotonic() - blocked_at < 2.5:
                states.add((await get_json(http, f"{sidecar.http_url}/ready"))["state"])
                await asyncio.sleep(0.1)
            others = await asyncio.gather(*(stream(http, gateway.http_url, 20) for _ in range(20)))
            consumed = await consumed_tokens(http, sidecar)
            rss_after = {"sidecar": rss_mb(sidecar), "gateway": rss_mb(gateway)}
            for sock in socks:
                sock.close()
            socks = []
            await all_settled(http, cell)
    finally:
        for sock in socks:
            sock.close()
    report(
        "clients that stop reading",
        rss_mb_before=rss_before,
        rss_mb_after=rss_after,
        gateway_rss_mb_when_blocked=gateway_blocked,
        sidecar_states_while_blocked=sorted(states),
        tokens_taken_while_blocked=consumed,
        other_clients=kinds(others),
    )
    assert rss_after["gateway"] - rss_before["gateway"] < 50, "the gateway buffers nothing"
    assert states == {"SERVING"}, "a client that stops reading is no engine stall"
    assert kinds(others) == Counter({"ok": 20}), "the engine kept serving other clients"


async def test_unread_streams_leave_the_sidecar_memory_bounded(procs: Procs) -> None:
    cell = await start_cell(procs, 1, "--sim-decode-step-ms", "0", followers=False)
    sidecar = cell.sidecars[0]
    before = rss_mb(sidecar)
    socks = [await unread_stream(port_of(sidecar)) for _ in range(4)]
    try:
        async with aiohttp.ClientSession() as http:
            await until_blocked(http, sidecar)
        await asyncio.sleep(6)
        grown = rss_mb(sidecar) - before
    finally:
        for sock in socks:
            sock.close()
    report("unread streams, sidecar memory", rss_growth_mb=round(grown))
    assert grown < 50


# -- many requests, some cancelled by their client ------------------------------------


async def one_request(
    http: aiohttp.ClientSession, url: str, rng: random.Random, tally: Counter[str]
) -> None:
    streaming, cancel = rng.random() < 0.5, rng.random() < 0.1
    # A cancelled request asks for many tokens, so it is surely running when it goes.
    body = {"prompt": "x", "max_tokens": 400 if cancel else 4, "stream": streaming}
    what = f"{'stream' if streaming else 'plain'} {'cancelled' if cancel else 'whole'}"
    # A plain request is cancelled 5-50 ms in; a stream once its first token came.
    limit = rng.uniform(0.005, 0.05) if cancel and not streaming else 30
    try:
        async with asyncio.timeout(limit):
            async with http.post(f"{url}/v1/completions", json=body) as resp:
                if cancel and streaming:
                    await resp.content.readline()
                    resp.close()
                    tally[f"{what}: closed after first byte"] += 1
                    return
                await resp.read()
                tally[f"{what}: {resp.status}"] += 1
    except TimeoutError:
        tally[f"{what}: {'gone' if cancel else 'TIMEOUT'}"] += 1


async def run_requests(url: str, total: int, concurrency: int, seed: int) -> Counter[str]:
    tally, rng = Counter[str](), random.Random(seed)
    queue = iter(range(total))
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as http:

        async def worker() -> None:
            for _ in queue:
                await one_request(http, url, rng, tally)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return tally


TCP_STATES = {"01": "ESTABLISHED", "06": "TIME_WAIT", "08": "CLOSE_WAIT", "0A": "LISTEN"}


def tcp_table() -> dict[str, tuple[int, int, str]]:
    """Socket inode -> (local port, remote port, state), for every TCP socket here."""
    table = {}
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(name).read_text().splitlines()[1:]:
            fields = line.split()
            local, remote, state, inode = fields[1], fields[2], fields[3], fields[9]
            ports = int(local.rsplit(":", 1)[1], 16), int(remote.rsplit(":", 1)[1], 16)
            table[inode] = (*ports, TCP_STATES.get(state, state))
    return table


def fd_census(proc: Proc, names: dict[int, str]) -> Counter[str]:
    """The process's open fds by kind: a TCP socket as ``STATE local->remote`` with the
    known ports by name (others ``*``), so a leaked connection shows as what it is."""
    table, census = tcp_table(), Counter[str]()
    for fd in Path(f"/proc/{proc.pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except FileNotFoundError:
            continue  # closed while we looked
        inode = target[len("socket:[") : -1] if target.startswith("socket:[") else None
        if inode in table:
            local, remote, state = table[inode]
            census[f"{state} {names.get(local, '*')}->{names.get(remote, '*')}"] += 1
        else:
            census["socket, not TCP" if inode else "not a socket"] += 1
    return census


def census_all(cell: Cell) -> dict[str, Counter[str]]:
    procs = {"gateway": cell.gateway} | {f"u{i}": s for i, s in enumerate(cell.sidecars)}
    names = {port_of(p): f"{name}-http" for name, p in procs.items()}
    names |= {int(p.grpc_target.rsplit(":", 1)[1]): f"{name}-grpc" for name, p in procs.items()}
    return {name: fd_census(p, names) for name, p in procs.items()}


def steady(census: Counter[str]) -> Counter[str]:
    """All but the HTTP connections, which come and go with requests and pools."""
    return Counter(
        {k: n for k, n in census.items() if not (k.startswith("ESTABLISHED") and "-http" in k)}
    )


async def test_ten_thousand_requests_with_cancellations_leak_nothing(procs: Procs) -> None:
    zero_delay = ("--sim-decode-step-ms", "0.2", "--sim-max-num-seqs", "64")
    cell = await start_cell(procs, 2, *zero_delay, followers=False)
    url = cell.gateway.http_url
    # Warm up at the same concurrency: pools reach their working size first.
    await run_requests(url, 500, 64, seed=1)
    async with aiohttp.ClientSession() as http:
        await all_settled(http, cell)
    await asyncio.sleep(0.5)
    before = census_all(cell)
    started = time.monotonic()
    tally = await run_requests(url, 10_000, 64, seed=2)
    seconds = time.monotonic() - started
    async with aiohttp.ClientSession() as http:
        settled = await all_settled(http, cell)
        gone = {p: await metric(http, p, 'unitproxy_requests_total{code="499"')
                for p in (cell.gateway, *cell.sidecars)}  # fmt: skip
    await asyncio.sleep(0.5)
    after = census_all(cell)
    report(
        "10,000 requests, 10 % cancelled by the client",
        seconds=round(seconds, 1),
        outcomes=tally,
        fds_before=before,
        fds_after=after,
        gateway_routed={u["id"]: u["routed"] for u in settled["gateway"]["units"]},
        gateway_ejections={u["id"]: u["ejected_for_s"] for u in settled["gateway"]["units"]},
        client_gone_499={"gateway": gone[cell.gateway],
                         "sidecars": sum(gone[s] for s in cell.sidecars)},
    )  # fmt: skip
    assert sum(tally.values()) == 10_000
    assert all(u["ejected_for_s"] == 0 for u in settled["gateway"]["units"]), "no unit ejected"
    assert not [k for k in tally if "TIMEOUT" in k or ("whole" in k and "200" not in k)]
    for name, census in after.items():
        # Every other fd is back where it was: no CLOSE_WAIT, no stray socket or file.
        assert steady(census) == steady(before[name]), (name, before[name], census)
    gateway = after["gateway"]
    assert gateway["ESTABLISHED gateway-http->*"] == 0, "every client connection closed"
    for unit in ("u0", "u1"):
        # The gateway's keep-alive pool to a unit may have grown, up to the concurrency;
        # the unit holds the other end of each one.
        pool = gateway[f"ESTABLISHED *->{unit}-http"]
        assert pool <= 64, gateway
        assert after[unit][f"ESTABLISHED {unit}-http->*"] == pool, after[unit]


async def test_client_cancellations_never_eject_a_unit(
    start_sidecar: SidecarFactory, start_gateway: GatewayFactory
) -> None:
    # A client that goes away says nothing about the unit: before the fix, three in a
    # row (HTTP before the response headers, gRPC at any point) ejected a healthy unit.
    a = await start_sidecar(sidecar={"unit_id": "a"})
    gw = await start_gateway([a])
    unit = gw.router.units["a"]
    async with aiohttp.ClientSession() as http:
        for _ in range(4):
            body = {"prompt": "x", "max_tokens": 100_000}
            task = asyncio.create_task(http.post(f"{gw.http_url}/v1/completions", json=body))
            await wait_until(lambda: unit.inflight == 1, what="request at the unit")
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await wait_until(lambda: unit.inflight == 0, what="request released")
    async with grpc.aio.insecure_channel(gw.grpc_target) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        sampling = inference_pb2.SamplingParams(max_tokens=100_000)
        for _ in range(4):
            call = stub.Generate(inference_pb2.GenerateRequest(prompt="x", sampling=sampling))
            await call.read()
            call.cancel()
            await wait_until(lambda: unit.inflight == 0, what="gRPC call released")
    assert unit.failures == 0 and unit.ejected_until == 0.0
    assert gw.router.serving() == [unit]
    await wait_until(lambda: a.core.outstanding == 0, what="unit outstanding 0")
