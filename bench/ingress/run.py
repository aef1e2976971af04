"""Hostile and careless clients against the gateway, while a normal client streams.

Starts a sidecar (engine sim) and a gateway (API keys on) as child processes on
127.0.0.1, then:

    baseline   the normal client streams completions at --concurrency for --duration s:
               TTFT of each stream, errors
    attack     --hostile connections (no API key, as an attacker has none), spread over
               five kinds, all open at once, then the normal client again, while the
               gateway's RSS is sampled

Hostile kinds (each records when the gateway closed it, from the start of its timer):

    slow-head      a head sent one byte every 0.5 s          head_timeout_s from byte 1
    slow-body      a whole head, then a body byte every 0.5 s body_timeout_s from the head
    one-short      a whole head and its body less one byte   body_timeout_s from the head
    expect         a head with Expect: 100-continue, no body  body_timeout_s from the head
    idle           GET /health, then nothing                  keepalive_timeout_s after it

Then one attack at a time (--attacks), each while the normal client streams again:

    pipelined      a long request (unstreamed), then 4 MiB pipelined behind it (with a key)
    declared-hold  a head announcing 4 MiB, then a body byte every 0.5 s (with a key)
    idle-sockets   connections that never send a byte
    upgrade        requests offering Upgrade: h2c or websocket, one every 0.5 s

Hostile connections come from 127.0.0.2 (the normal client from 127.0.0.1), so the
per-address cap (server.max_connections_per_client) falls on them alone.

Goals: gateway RSS at most 200 MB with every hostile connection open; each closed
within its timeout (plus one second of slack); the normal client's TTFT p99 under
attack within 2x of the baseline, and no error; the same RSS, TTFT and error goals
under each single attack.

Then, in a cell of its own with a fast unit, --grpc-unread gRPC Generate streams (10)
that their client opens and never reads, beside the normal client: the gateway must
give each up (DEADLINE_EXCEEDED) once flow control has held its writer for
server.write_timeout_s (2 s with --quick, else 60), freeing its unit slot, with its
RSS and the normal client's TTFT p99 held to the same goals.

    .venv/bin/python bench/ingress/run.py            # 1,000 connections, default limits (~4 min)
    .venv/bin/python bench/ingress/run.py --quick    # 200 connections, 1-3 s limits (~1 min)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: make the bench package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import aiohttp
import grpc

from bench.common import code_version, cpu_model, free_ports, loop_name, run_loop, until_signal
from proxy.procutil import python_m, running

REPO = Path(__file__).resolve().parents[2]
DEFAULT_OUT = REPO / "bench" / "results" / "ingress.json"
HOST = "127.0.0.1"
KEY = "sk-bench-ingress"
KINDS = ("slow-head", "slow-body", "one-short", "expect", "idle")
ATTACKS = ("pipelined", "declared-hold", "idle-sockets", "upgrade")
HOSTILE_ADDRESS = "127.0.0.2"  # where hostile connections come from (loopback)
PIPELINED = 4 * 1024 * 1024  # bytes a pipelining client sends behind its request
SLACK_S = 1.0  # a close may come this much after its timeout (timer grain, a busy loop)
RSS_GOAL_MB = 200.0
TTFT_GOAL_RATIO = 2.0
START_TIMEOUT_S = 30.0
BATCH = 100  # hostile connections opened at once
BODY = json.dumps({"prompt": "x" * 64, "max_tokens": 16, "stream": True}).encode()
BIG = 4 * 1024 * 1024 - 1  # the one-short body announces this many bytes
ALMOST = b"x" * (BIG - 1)


@dataclass
class Limits:
    head_s: float
    body_s: float
    keepalive_s: float

    def flags(self) -> list[str]:
        return ["--head-timeout", str(self.head_s), "--body-timeout", str(self.body_s),
                "--keepalive-timeout", str(self.keepalive_s)]  # fmt: skip

    def timeout(self, kind: str) -> float:
        if kind == "slow-head":
            return self.head_s
        return self.keepalive_s if kind == "idle" else self.body_s


@dataclass
class Hostile:
    kind: str
    timer_started: float = 0.0
    closed_after_s: float | None = None  # from timer_started; None: still open at the end
    answer: int = 0  # the HTTP status the gateway sent, 0 if none
    failed: str = ""  # why the connection could not be opened and played


@dataclass
class Streams:
    ttft_ms: list[float] = field(default_factory=list)
    errors: int = 0

    def p(self, q: float) -> float:
        if not self.ttft_ms:
            return float("nan")
        ordered = sorted(self.ttft_ms)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# -- processes -------------------------------------------------------------------------


@asynccontextmanager
async def cell(limits: Limits, workdir: Path) -> AsyncIterator[tuple[str, int]]:
    """A sidecar and a gateway; yields the gateway's URL and pid. Started by the shared
    launcher, not ``unitproxy up``: up gives its gateway neither these limits nor keys."""
    s_http, s_grpc, g_http, g_grpc = free_ports(4)
    sidecar = ["sidecar", "--host", HOST, "--http-port", str(s_http), "--grpc-port", str(s_grpc),
               "--unit-id", "u0", "--capacity", "256", "--sim-max-num-seqs", "256",
               "--sim-decode-step-ms", "5", "--sim-prefill-ms-per-token", "0",
               "--sim-decode-ms-per-seq", "0",
               "--log-level", "warning"]  # fmt: skip
    gateway = ["gateway", "--host", HOST, "--http-port", str(g_http), "--grpc-port", str(g_grpc),
               "--unit", f"u0=http://{HOST}:{s_http},{HOST}:{s_grpc}", "--log-level", "warning",
               "--max-connections", "4096", *limits.flags()]  # fmt: skip
    keys = {"UNITPROXY_SERVER__API_KEYS": json.dumps([KEY])}
    stop_s = 5.0  # SIGTERM, then SIGKILL after this
    async with running("sidecar", python_m(*sidecar), workdir / "sidecar.log", cwd=REPO,
                       stop_timeout_s=stop_s) as unit:  # fmt: skip
        unit.http_url = f"http://{HOST}:{s_http}"
        await unit.until_ready(START_TIMEOUT_S)
        async with running("gateway", python_m(*gateway), workdir / "gateway.log", env=keys,
                           cwd=REPO, stop_timeout_s=stop_s) as gw:  # fmt: skip
            gw.http_url = f"http://{HOST}:{g_http}"
            await gw.until_ready(START_TIMEOUT_S)
            yield gw.http_url, gw.pid


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


# -- the normal client -------------------------------------------------------------------


async def stream_once(http: aiohttp.ClientSession, url: str, streams: Streams) -> None:
    started = time.perf_counter()
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    try:
        async with http.post(f"{url}/v1/completions", data=BODY, headers=headers) as resp:
            if resp.status != 200:
                streams.errors += 1
                await resp.read()
                return
            first = True
            async for line in resp.content:
                if first and line.startswith(b"data: "):
                    streams.ttft_ms.append((time.perf_counter() - started) * 1000)
                    first = False
                if line.startswith(b"data: [DONE]"):
                    return
                if line.startswith(b'data: {"error"'):
                    streams.errors += 1
                    return
            streams.errors += 1  # ended without [DONE]
    except (aiohttp.ClientError, TimeoutError):
        streams.errors += 1


async def normal_client(url: str, concurrency: int, duration_s: float) -> Streams:
    streams = Streams()
    stop_at = time.monotonic() + duration_s
    timeout = aiohttp.ClientTimeout(total=30)
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:

        async def worker() -> None:
            while time.monotonic() < stop_at:
                await stream_once(http, url, streams)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return streams


# -- hostile clients ---------------------------------------------------------------------


# --with-key: the hostile clients hold a valid API key (a careless client, not an attacker).
HOSTILE_AUTH: list[str] = []


def head(length: int, *extra: str) -> bytes:
    lines = ["POST /v1/completions HTTP/1.1", f"Host: {HOST}", "Content-Type: application/json",
             f"Content-Length: {length}", *HOSTILE_AUTH, *extra]  # fmt: skip
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


async def hostile(url: str, h: Hostile, opened: asyncio.Event, stop: asyncio.Event) -> None:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    try:
        reader, writer = await asyncio.open_connection(
            host, int(port), local_addr=(HOSTILE_ADDRESS, 0)
        )
    except OSError as exc:
        h.failed = f"connect: {exc.strerror or exc}"
        opened.set()
        return
    try:
        await _play(h, reader, writer, opened)
        got = b""
        read = asyncio.ensure_future(reader.read())  # until the gateway closes
        trickle = asyncio.ensure_future(_trickle(h, writer, stop))
        try:
            done, _ = await asyncio.wait({read, asyncio.ensure_future(stop.wait())},
                                         return_when=asyncio.FIRST_COMPLETED)  # fmt: skip
            if read in done:
                with contextlib.suppress(ConnectionError):
                    got = read.result()
                h.closed_after_s = time.monotonic() - h.timer_started
        finally:
            for task in (read, trickle):
                task.cancel()
        if h.kind != "idle" and got.startswith(b"HTTP/1.1 "):
            h.answer = int(got[9:12])
    except ConnectionError as exc:
        if opened.is_set():
            h.closed_after_s = time.monotonic() - h.timer_started
        else:
            h.failed = f"while opening: {exc}"
    finally:
        opened.set()
        writer.close()


async def _play(
    h: Hostile, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, opened: asyncio.Event
) -> None:
    if h.kind == "idle":
        writer.write(f"GET /health HTTP/1.1\r\nHost: {HOST}\r\n\r\n".encode())
        response = await reader.readuntil(b"\r\n\r\n")
        length = int(response.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        await reader.readexactly(length)
    elif h.kind == "slow-head":
        writer.write(b"P")
    elif h.kind == "slow-body":
        writer.write(head(len(BODY)) + BODY[:1])
    elif h.kind == "one-short":
        writer.write(head(BIG))
        writer.write(ALMOST)
        await writer.drain()
    elif h.kind == "expect":
        writer.write(head(len(BODY), "Expect: 100-continue"))
    h.timer_started = time.monotonic()
    opened.set()


async def _trickle(h: Hostile, writer: asyncio.StreamWriter, stop: asyncio.Event) -> None:
    """Slow kinds keep sending, one byte every 0.5 s."""
    if h.kind not in ("slow-head", "slow-body"):
        return
    rest = (head(len(BODY))[1:] if h.kind == "slow-head" else BODY[1:]) * 100
    for byte in rest:
        await asyncio.sleep(0.5)
        writer.write(bytes([byte]))
    await stop.wait()


# -- single attacks -----------------------------------------------------------------------


@dataclass
class Played:
    """What one attacking connection saw."""

    answers: list[int] = field(default_factory=list)  # statuses the gateway sent
    closed_by_gateway: bool = False
    empty_replies: int = 0  # requests the gateway closed on without an answer
    failed: str = ""


def keyed_head(length: int, *extra: str, path: str = "/v1/completions") -> bytes:
    lines = [f"POST {path} HTTP/1.1", f"Host: {HOST}", "Content-Type: application/json",
             f"Authorization: Bearer {KEY}", f"Content-Length: {length}", *extra]  # fmt: skip
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


async def read_answer(reader: asyncio.StreamReader) -> int:
    """The status of one whole answer (Content-Length framed); 0 if the connection closed."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, ConnectionError):
        return 0
    lower = head.lower()
    if b"content-length: " in lower:
        await reader.readexactly(int(lower.split(b"content-length: ")[1].split(b"\r\n")[0]))
    return int(head[9:12])


async def play_attack(name: str, url: str, p: Played, opened: asyncio.Event,
                      stop: asyncio.Event) -> None:  # fmt: skip
    """One attacking client until ``stop``; the ones the gateway closes by a timer
    (declared-hold, idle-sockets) connect again, as an attacker would."""
    try:
        while True:
            await _attack_once(name, url, p, opened, stop)
            if stop.is_set() or name not in ("declared-hold", "idle-sockets") or p.failed:
                return
    finally:
        opened.set()


async def _attack_once(name: str, url: str, p: Played, opened: asyncio.Event,
                       stop: asyncio.Event) -> None:  # fmt: skip
    host, port = url.removeprefix("http://").rsplit(":", 1)
    try:
        reader, writer = await asyncio.open_connection(
            host, int(port), local_addr=(HOSTILE_ADDRESS, 0)
        )
    except OSError as exc:
        p.failed = f"connect: {exc.strerror or exc}"
        return
    try:
        if name == "upgrade":
            opened.set()
            await _upgrades(reader, writer, p, stop)
            return
        if name == "pipelined":
            body = json.dumps({"prompt": "x", "max_tokens": 100_000}).encode()
            writer.write(keyed_head(len(body)) + body)
            opened.set()
            chunk = b"x" * 65536
            for _ in range(PIPELINED // len(chunk)):  # until the gateway stops reading
                writer.write(chunk)
                await _drain_or_stop(writer, stop)
                if stop.is_set():
                    break
        elif name == "declared-hold":
            writer.write(keyed_head(4 * 1024 * 1024) + b"{")
            opened.set()
        else:
            opened.set()  # idle-sockets: not a byte
        read = asyncio.ensure_future(reader.read())
        waiting = asyncio.ensure_future(stop.wait())
        trickle = asyncio.ensure_future(_trickle_body(writer, stop, name == "declared-hold"))
        try:
            done, _ = await asyncio.wait({read, waiting}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (read, waiting, trickle):
                task.cancel()
        if read in done:
            got = b""
            with contextlib.suppress(ConnectionError):
                got = read.result()
            p.closed_by_gateway = True
            if got.startswith(b"HTTP/1.1 "):
                p.answers.append(int(got[9:12]))
    except ConnectionError as exc:
        p.closed_by_gateway = True
        p.failed = p.failed or type(exc).__name__
    finally:
        writer.close()


async def _trickle_body(writer: asyncio.StreamWriter, stop: asyncio.Event, on: bool) -> None:
    """declared-hold: a body byte every 0.5 s (other kinds send nothing more)."""
    if not on:
        return
    with contextlib.suppress(ConnectionError):
        while not stop.is_set():
            await asyncio.sleep(0.5)
            writer.write(b" ")


async def _upgrades(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, p: Played, stop: asyncio.Event
) -> None:
    """Requests offering Upgrade (h2c, websocket; inference and GET /health), one at a
    time on one connection; an empty reply ends it."""
    body = json.dumps({"prompt": "x", "max_tokens": 2}).encode()
    offers = [("Connection: Upgrade, HTTP2-Settings", "Upgrade: h2c",
               "HTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA"),
              ("Connection: Upgrade", "Upgrade: websocket", "Sec-WebSocket-Version: 13",
               "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==")]  # fmt: skip
    i = 0
    while not stop.is_set():
        offer = offers[i % 2]
        if i % 4 < 2:
            writer.write(keyed_head(len(body), *offer) + body)
        else:
            lines = ["GET /health HTTP/1.1", f"Host: {HOST}", *offer]
            writer.write(("\r\n".join(lines) + "\r\n\r\n").encode())
        i += 1
        status = await read_answer(reader)
        if not status:
            p.empty_replies += 1
            return
        p.answers.append(status)
        await asyncio.sleep(0.5)


async def _drain_or_stop(writer: asyncio.StreamWriter, stop: asyncio.Event) -> None:
    drain = asyncio.ensure_future(writer.drain())
    waiting = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({drain, waiting}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        drain.cancel()
        waiting.cancel()


async def attack_worker(url: str, name: str, n: int, hold_s: float) -> None:
    """One attack, in a process of its own: prints OPEN once every connection plays,
    holds them ``hold_s``, then prints what they saw."""
    stop = asyncio.Event()
    played = [Played() for _ in range(n)]
    opened = [asyncio.Event() for _ in played]
    tasks = []
    async with asyncio.timeout(START_TIMEOUT_S):
        for i in range(0, n, BATCH):
            batch = list(zip(played[i : i + BATCH], opened[i : i + BATCH], strict=True))
            tasks += [asyncio.ensure_future(play_attack(name, url, p, o, stop)) for p, o in batch]
            await asyncio.gather(*(o.wait() for _, o in batch))
    print("OPEN", flush=True)
    await asyncio.sleep(hold_s)
    stop.set()
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(10):
            await asyncio.gather(*tasks, return_exceptions=True)
    print(json.dumps([asdict(p) for p in played]), flush=True)


def attack_counts(quick: bool) -> dict[str, int]:
    if quick:
        return {"pipelined": 50, "declared-hold": 32, "idle-sockets": 500, "upgrade": 50}
    return {"pipelined": 100, "declared-hold": 64, "idle-sockets": 2000, "upgrade": 100}


async def single_attack(url: str, pid: int, name: str, n: int, duration_s: float,
                        concurrency: int) -> dict[str, Any]:  # fmt: skip
    stop = asyncio.Event()
    rss_samples = [rss_mb(pid)]

    async def sample() -> None:
        with contextlib.suppress(OSError):
            while not stop.is_set():
                rss_samples.append(rss_mb(pid))
                await asyncio.sleep(0.25)

    sampler = asyncio.ensure_future(sample())
    worker = await asyncio.create_subprocess_exec(
        sys.executable, __file__, "--attack-worker", url, "--attack", name,
        "--hostile", str(n), "--hold", str(duration_s + 1.0),
        stdout=asyncio.subprocess.PIPE, limit=64 << 20,
    )  # fmt: skip
    assert worker.stdout is not None
    try:
        async with asyncio.timeout(START_TIMEOUT_S):
            line = await worker.stdout.readline()
        if line.strip() != b"OPEN":
            raise RuntimeError(f"the {name} worker failed: {line[:300]!r}")
        await asyncio.sleep(0.5)  # the attack settles (the gateway reads what it takes)
        streams = await normal_client(url, concurrency, duration_s)
        async with asyncio.timeout(60):
            found = json.loads(await worker.stdout.readline())
            await worker.wait()
    finally:
        if worker.returncode is None:
            worker.kill()
            await worker.wait()
        stop.set()
        await sampler
    played = [Played(**p) for p in found]
    answers: dict[str, int] = {}
    for p in played:
        for status in set(p.answers):
            answers[str(status)] = answers.get(str(status), 0) + 1
    return {
        "connections": n,
        "rss_before_mb": round(rss_samples[0], 1),
        "rss_max_mb": round(max(rss_samples), 1),
        "streams": len(streams.ttft_ms),
        "errors": streams.errors,
        "ttft_p50_ms": streams.p(0.5),
        "ttft_p99_ms": streams.p(0.99),
        "closed_by_gateway": sum(p.closed_by_gateway for p in played),
        "connections_answered": answers,  # status: connections that got it at least once
        "empty_replies": sum(p.empty_replies for p in played),
        "failed": [p.failed for p in played if p.failed][:3],
    }


# -- the run ---------------------------------------------------------------------------


async def hostile_worker(url: str, n: int, kinds: list[str], limits: Limits) -> None:
    """The hostile side, in a process of its own (so its thousands of timers do not
    slow the normal client it is measured against): prints OPEN once every connection
    is open, then, once each is closed or its timeout has long passed, the results."""
    stop = asyncio.Event()
    hostiles = [Hostile(kinds[i % len(kinds)]) for i in range(n)]
    opened = [asyncio.Event() for _ in hostiles]
    tasks = []
    async with asyncio.timeout(START_TIMEOUT_S):
        for i in range(0, n, BATCH):  # in batches, as a listen backlog holds only so many
            batch = list(zip(hostiles[i : i + BATCH], opened[i : i + BATCH], strict=True))
            tasks += [asyncio.ensure_future(hostile(url, h, o, stop)) for h, o in batch]
            await asyncio.gather(*(o.wait() for _, o in batch))
    all_open_at = time.monotonic()
    open_s = all_open_at - min(h.timer_started or all_open_at for h in hostiles)
    print("OPEN", flush=True)
    longest = max(limits.timeout(kind) for kind in kinds)
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(longest + 2 * SLACK_S):
            await asyncio.gather(*tasks, return_exceptions=True)
    stop.set()
    await asyncio.gather(*tasks, return_exceptions=True)
    print(json.dumps({"open_s": open_s, "hostiles": [asdict(h) for h in hostiles]}), flush=True)


async def attack(url: str, pid: int, args: argparse.Namespace, n: int, duration_s: float,
                 limits: Limits) -> dict[str, Any]:  # fmt: skip
    stop = asyncio.Event()
    rss_samples = [rss_mb(pid)]

    async def sample() -> None:
        with contextlib.suppress(OSError):  # the gateway gone: the run fails elsewhere
            while not stop.is_set():
                rss_samples.append(rss_mb(pid))
                await asyncio.sleep(0.25)

    sampler = asyncio.ensure_future(sample())
    worker = await asyncio.create_subprocess_exec(
        sys.executable, __file__, "--hostile-worker", url, "--hostile", str(n),
        "--kinds", *args.kinds, *(["--quick"] if args.quick else []),
        *(["--with-key"] if args.with_key else []),
        stdout=asyncio.subprocess.PIPE, limit=64 << 20,
    )  # fmt: skip
    assert worker.stdout is not None
    try:
        async with asyncio.timeout(START_TIMEOUT_S):
            line = await worker.stdout.readline()
        if line.strip() != b"OPEN":
            raise RuntimeError(f"the hostile worker failed: {line[:300]!r}")
        streams = await normal_client(url, args.concurrency, duration_s)
        async with asyncio.timeout(max(limits.timeout(k) for k in args.kinds) + 30):
            found = json.loads(await worker.stdout.readline())
            await worker.wait()
    finally:
        if worker.returncode is None:
            worker.kill()
            await worker.wait()
        stop.set()
        await sampler
    hostiles = [Hostile(**h) for h in found["hostiles"]]
    return {"hostiles": hostiles, "streams": streams, "rss_before_mb": rss_samples[0],
            "rss_max_mb": max(rss_samples), "open_s": found["open_s"]}  # fmt: skip


def summarize(hostiles: list[Hostile], limits: Limits) -> dict[str, dict[str, Any]]:
    out = {}
    for kind in sorted({h.kind for h in hostiles}, key=KINDS.index):
        mine = [h for h in hostiles if h.kind == kind]
        closed = [h.closed_after_s for h in mine if h.closed_after_s is not None]
        limit = limits.timeout(kind)
        out[kind] = {
            "connections": len(mine),
            "timeout_s": limit,
            "closed_in_time": sum(1 for c in closed if c <= limit + SLACK_S),
            "still_open": len(mine) - len(closed),
            "close_s_min": round(min(closed), 3) if closed else None,
            "close_s_max": round(max(closed), 3) if closed else None,
            "answers": sorted({h.answer for h in mine}),
            "failed": [h.failed for h in mine if h.failed][:3],
        }
    return out


def limits_of(args: argparse.Namespace) -> Limits:
    return Limits(1.0, 2.0, 3.0) if args.quick else Limits(10.0, 30.0, 75.0)


async def main(args: argparse.Namespace) -> dict[str, Any]:
    limits = limits_of(args)
    n = args.hostile or (200 if args.quick else 1000)
    duration_s = args.duration or (3.0 if args.quick else 10.0)
    with tempfile.TemporaryDirectory(prefix="bench-ingress-") as tmp:
        async with cell(limits, Path(tmp)) as (url, pid):
            await normal_client(url, args.concurrency, 1.0)  # warm up
            baseline = await normal_client(url, args.concurrency, duration_s)
            result = await attack(url, pid, args, n, duration_s, limits)
            counts = attack_counts(args.quick)
            attacks = {}
            for name in args.attacks:
                await asyncio.sleep(1.0)  # what the last attack left closes
                attacks[name] = await single_attack(
                    url, pid, name, counts[name], duration_s, args.concurrency
                )
        grpc_unread = await grpc_unread_phase(args, Path(tmp)) if args.grpc_unread else None
    for a in attacks.values():
        a["ttft_p99_ratio"] = (
            a["ttft_p99_ms"] / baseline.p(0.99) if baseline.ttft_ms else float("nan")
        )
    streams: Streams = result["streams"]
    kinds = summarize(result["hostiles"], limits)
    ratio = streams.p(0.99) / baseline.p(0.99) if baseline.ttft_ms else float("nan")
    closed_in_time = sum(k["closed_in_time"] for k in kinds.values())
    return {
        "when": datetime.now(UTC).isoformat(timespec="seconds"),
        "code": code_version(),
        "machine": {"cpu": cpu_model(), "cpus": os.cpu_count(), "loop": loop_name()},
        "quick": args.quick,
        "limits": asdict(limits),
        "hostile_connections": n,
        "kinds_played": args.kinds,
        "hostile_with_key": args.with_key,
        "concurrency": args.concurrency,
        "duration_s": duration_s,
        "baseline": {"streams": len(baseline.ttft_ms), "errors": baseline.errors,
                     "ttft_p50_ms": baseline.p(0.5), "ttft_p99_ms": baseline.p(0.99)},
        "under_attack": {"streams": len(streams.ttft_ms), "errors": streams.errors,
                         "ttft_p50_ms": streams.p(0.5), "ttft_p99_ms": streams.p(0.99)},
        "ttft_p99_ratio": ratio,
        "rss_before_mb": round(result["rss_before_mb"], 1),
        "rss_max_mb": round(result["rss_max_mb"], 1),
        "all_open_after_s": round(result["open_s"], 2),
        "kinds": kinds,
        "grpc_unread": grpc_unread,
        "attacks": attacks,
        "goals": {
            "rss_max_mb <= 200": result["rss_max_mb"] <= RSS_GOAL_MB,
            "every hostile connection closed in time": closed_in_time == n,
            "ttft p99 within 2x": ratio <= TTFT_GOAL_RATIO,
            "no error": streams.errors == 0 and baseline.errors == 0,
            **({} if grpc_unread is None
               else {f"gRPC unread: {k}": v for k, v in grpc_unread["goals"].items()}),
            **{f"{name}: rss_max_mb <= 200": a["rss_max_mb"] <= RSS_GOAL_MB
               for name, a in attacks.items()},
            **{f"{name}: ttft p99 within 2x": a["ttft_p99_ratio"] <= TTFT_GOAL_RATIO
               for name, a in attacks.items()},
            **{f"{name}: no error": a["errors"] == 0 and a["empty_replies"] == 0
               for name, a in attacks.items()},
        },
    }  # fmt: skip


def table(r: dict[str, Any]) -> str:
    b, a = r["baseline"], r["under_attack"]
    lines = [
        f"gateway under {r['hostile_connections']} hostile connections "
        f"(limits {r['limits']}), normal client at concurrency {r['concurrency']}",
        f"{'':14} {'streams':>8} {'errors':>7} {'TTFT p50 ms':>12} {'TTFT p99 ms':>12}",
        f"{'baseline':14} {b['streams']:>8} {b['errors']:>7} {b['ttft_p50_ms']:>12.1f} "
        f"{b['ttft_p99_ms']:>12.1f}",
        f"{'under attack':14} {a['streams']:>8} {a['errors']:>7} {a['ttft_p50_ms']:>12.1f} "
        f"{a['ttft_p99_ms']:>12.1f}",
        f"TTFT p99 ratio {r['ttft_p99_ratio']:.2f}; gateway RSS {r['rss_before_mb']} MB before, "
        f"{r['rss_max_mb']} MB at most under attack",
        "",
        f"{'kind':10} {'conns':>6} {'timeout s':>9} {'in time':>8} {'open':>5} "
        f"{'close s min':>11} {'max':>7}  answers",
    ]
    for kind, k in r["kinds"].items():
        lines.append(
            f"{kind:10} {k['connections']:>6} {k['timeout_s']:>9g} {k['closed_in_time']:>8} "
            f"{k['still_open']:>5} {k['close_s_min']!s:>11} {k['close_s_max']!s:>7}  {k['answers']}"
        )
    if r.get("grpc_unread"):
        lines += ["", grpc_unread_table(r["grpc_unread"])]
    if r["attacks"]:
        lines += [
            "",
            f"{'attack':14} {'conns':>6} {'RSS MB':>7} {'TTFT p99 ms':>12} {'ratio':>6} "
            f"{'errors':>7} {'closed':>7} {'empty':>6}  answers (connections)",
        ]
        for name, a in r["attacks"].items():
            lines.append(
                f"{name:14} {a['connections']:>6} {a['rss_max_mb']:>7} "
                f"{a['ttft_p99_ms']:>12.1f} {a['ttft_p99_ratio']:>6.2f} {a['errors']:>7} "
                f"{a['closed_by_gateway']:>7} {a['empty_replies']:>6}  "
                f"{a['connections_answered']}"
            )
    lines.append("")
    lines += [f"{'met' if ok else 'MISSED'}: {goal}" for goal, ok in r["goals"].items()]
    return "\n".join(lines)


# -- never-reading gRPC clients ------------------------------------------------------------
# Generate streams that a client opens and never reads, on a fast unit, while the normal
# client streams beside them: the gateway must give each up once flow control has held
# its writer for server.write_timeout_s, so the unit's slot frees, and hold bounded memory
# meanwhile. In a cell of its own (the gRPC port and a fast unit), run after the others.
# A default grpc.aio channel's transport takes its whole window (a few MB per stream on
# loopback) before flow control holds anything: --grpc-unread-window default plays that,
# which at the simulator's speed takes minutes; the default plays a 64 KB window.

GRPC_UNREAD_REQUEST_TOKENS = 10_000_000  # never reached: the stream is given up first
GRPC_FREE_SLACK_S = 10.0  # past write_timeout_s, for the window to fill and the timer grain


@asynccontextmanager
async def grpc_cell(workdir: Path, write_timeout_s: float) -> AsyncIterator[dict[str, Any]]:
    """A fast sidecar and a gateway (no API keys) for the gRPC attack."""
    s_http, s_grpc, g_http, g_grpc = free_ports(4)
    limit = ["--write-timeout", str(write_timeout_s), "--log-level", "warning"]
    sidecar = ["sidecar", "--host", HOST, "--http-port", str(s_http), "--grpc-port", str(s_grpc),
               "--unit-id", "u0", "--capacity", "256", "--sim-max-num-seqs", "256",
               "--sim-decode-step-ms", "0.2", "--sim-prefill-ms-per-token", "0", *limit]  # fmt: skip
    gateway = ["gateway", "--host", HOST, "--http-port", str(g_http), "--grpc-port", str(g_grpc),
               "--unit", f"u0=http://{HOST}:{s_http},{HOST}:{s_grpc}", *limit]  # fmt: skip
    async with running("sidecar", python_m(*sidecar), workdir / "grpc-sidecar.log", cwd=REPO,
                       stop_timeout_s=5.0) as unit:  # fmt: skip
        unit.http_url = f"http://{HOST}:{s_http}"
        await unit.until_ready(START_TIMEOUT_S)
        async with running("gateway", python_m(*gateway), workdir / "grpc-gateway.log",
                           cwd=REPO, stop_timeout_s=5.0) as gw:  # fmt: skip
            gw.http_url = f"http://{HOST}:{g_http}"
            await gw.until_ready(START_TIMEOUT_S)
            yield {"url": gw.http_url, "grpc": f"{HOST}:{g_grpc}", "pid": gw.pid,
                   "unit": unit.http_url}  # fmt: skip


async def grpc_unread_worker(target: str, n: int, small_window: bool) -> None:
    """Opens ``n`` Generate streams and reads none; prints OPEN once each has its first
    message; on a line on stdin reads them all and prints how each ended."""
    from proxy.pb.unitproxy.v1 import inference_pb2, inference_pb2_grpc

    options = [("grpc.http2.bdp_probe", 0)] if small_window else []
    request = inference_pb2.GenerateRequest(
        prompt="x", sampling=inference_pb2.SamplingParams(max_tokens=GRPC_UNREAD_REQUEST_TOKENS)
    )
    async with grpc.aio.insecure_channel(target, options=options) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        calls = [stub.Generate(request) for _ in range(n)]
        async with asyncio.timeout(START_TIMEOUT_S):
            await asyncio.gather(*(call.initial_metadata() for call in calls))
        print("OPEN", flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        ended = await asyncio.gather(*(how_it_ends(call) for call in calls))
        print(json.dumps({code: ended.count(code) for code in set(ended)}), flush=True)


async def how_it_ends(call: Any) -> str:
    """The status a call ends with once read, or "still open" after 10 s of reading."""
    try:
        async with asyncio.timeout(10):
            async for _ in call:
                pass
        return "OK"
    except grpc.aio.AioRpcError as exc:
        return str(exc.code().name)
    except TimeoutError:
        call.cancel()
        return "still open"


STALLED = 'unitproxy_requests_total{code="DEADLINE_EXCEEDED",route="grpc_generate"}'


async def until_given_up(gateway_url: str, n: int, limit_s: float) -> float | None:
    """Seconds until the gateway has ended ``n`` gRPC calls with DEADLINE_EXCEEDED (its
    write timeout), polled from its /metrics; None if not within ``limit_s``."""
    started = time.monotonic()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
        while time.monotonic() - started < limit_s:
            async with http.get(f"{gateway_url}/metrics") as resp:
                text = await resp.text()
            counted = [float(line.split()[-1]) for line in text.splitlines()
                       if line.startswith(STALLED)]  # fmt: skip
            if counted and counted[0] >= n:
                return time.monotonic() - started
            await asyncio.sleep(0.1)
    return None


async def unit_outstanding(unit_url: str) -> int:
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http,
        http.get(f"{unit_url}/load") as resp,
    ):
        return int((await resp.json())["outstanding"])


async def grpc_unread_phase(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    write_timeout_s = 2.0 if args.quick else 60.0
    duration_s = args.duration or (3.0 if args.quick else 10.0)
    n = args.grpc_unread
    async with grpc_cell(workdir, write_timeout_s) as cell_:
        url = cell_["url"]
        await normal_client(url, args.concurrency, 1.0)  # warm up
        baseline = await normal_client(url, args.concurrency, duration_s)
        rss = [rss_mb(cell_["pid"])]
        worker = await asyncio.create_subprocess_exec(
            sys.executable, __file__, "--grpc-unread-worker", cell_["grpc"],
            "--grpc-unread", str(n), "--grpc-unread-window", args.grpc_unread_window,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        )  # fmt: skip
        assert worker.stdin is not None and worker.stdout is not None
        stop = asyncio.Event()

        async def sample() -> None:
            with contextlib.suppress(OSError):
                while not stop.is_set():
                    rss.append(rss_mb(cell_["pid"]))
                    await asyncio.sleep(0.25)

        sampler = asyncio.ensure_future(sample())
        try:
            async with asyncio.timeout(START_TIMEOUT_S):
                line = await worker.stdout.readline()
            if line.strip() != b"OPEN":
                raise RuntimeError(f"the gRPC worker failed: {line[:300]!r}")
            limit_s = write_timeout_s + GRPC_FREE_SLACK_S
            given_up = asyncio.ensure_future(until_given_up(url, n, limit_s))
            attacked = await normal_client(url, args.concurrency, duration_s)
            given_up_after_s = await given_up
            # The normal client is done and the unread calls are still open: every
            # request the unit holds now is one of theirs.
            left = await unit_outstanding(cell_["unit"])
            worker.stdin.write(b"read\n")
            await worker.stdin.drain()
            async with asyncio.timeout(60):
                codes = json.loads(await worker.stdout.readline())
                await worker.wait()
        finally:
            if worker.returncode is None:
                worker.kill()
                await worker.wait()
            stop.set()
            await sampler
    ratio = attacked.p(0.99) / baseline.p(0.99) if baseline.ttft_ms else float("nan")
    return {
        "streams": n,
        "window": args.grpc_unread_window,
        "write_timeout_s": write_timeout_s,
        "baseline": {"streams": len(baseline.ttft_ms), "errors": baseline.errors,
                     "ttft_p99_ms": baseline.p(0.99)},
        "under_attack": {"streams": len(attacked.ttft_ms), "errors": attacked.errors,
                         "ttft_p99_ms": attacked.p(0.99)},
        "ttft_p99_ratio": ratio,
        "rss_before_mb": round(rss[0], 1),
        "rss_max_mb": round(max(rss), 1),
        "given_up_after_s": None if given_up_after_s is None else round(given_up_after_s, 2),
        "unit_slots_held_after": left,
        "ended": codes,
        "goals": {
            "rss_max_mb <= 200": max(rss) <= RSS_GOAL_MB,
            "every unread call given up, its unit slot freed": (
                given_up_after_s is not None and left == 0
            ),
            "ttft p99 within 2x": ratio <= TTFT_GOAL_RATIO,
            "no error": attacked.errors == 0 and baseline.errors == 0,
        },
    }  # fmt: skip


def grpc_unread_table(g: dict[str, Any]) -> str:
    lines = [
        f"{g['streams']} gRPC streams never read ({g['window']} window, write timeout "
        f"{g['write_timeout_s']:g} s), normal client beside them",
        f"TTFT p99 {g['baseline']['ttft_p99_ms']:.1f} ms before, "
        f"{g['under_attack']['ttft_p99_ms']:.1f} ms under attack (ratio "
        f"{g['ttft_p99_ratio']:.2f}); gateway RSS {g['rss_before_mb']} MB before, "
        f"{g['rss_max_mb']} MB at most",
        f"all given up {g['given_up_after_s']} s after the streams opened, unit slots "
        f"still held then {g['unit_slots_held_after']}; the streams ended {g['ended']}",
    ]
    lines += [f"{'met' if ok else 'MISSED'}: {goal}" for goal, ok in g["goals"].items()]
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="200 connections, 1-3 s limits")
    parser.add_argument("--hostile", type=int, default=0, help="hostile connections")
    parser.add_argument("--concurrency", type=int, default=16, help="normal client streams")
    parser.add_argument("--duration", type=float, default=0.0, help="normal client, s per phase")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON result")
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS),
                        help="hostile kinds, spread evenly (default: all)")  # fmt: skip
    parser.add_argument("--with-key", action="store_true",
                        help="hostile clients send a valid API key")  # fmt: skip
    parser.add_argument("--grpc-unread", type=int, default=10,
                        help="gRPC streams opened and never read (0: skip that attack)")  # fmt: skip
    parser.add_argument("--grpc-unread-window", choices=("small", "default"), default="small",
                        help="their client's HTTP/2 window: 64 KB, or grpc's own")  # fmt: skip
    parser.add_argument("--grpc-unread-worker", metavar="TARGET", help=argparse.SUPPRESS)
    parser.add_argument("--attacks", nargs="*", choices=ATTACKS, default=list(ATTACKS),
                        help="single attacks played after the mixed one (default: all)")  # fmt: skip
    parser.add_argument("--hostile-worker", metavar="URL", help=argparse.SUPPRESS)
    parser.add_argument("--attack-worker", metavar="URL", help=argparse.SUPPRESS)
    parser.add_argument("--attack", choices=ATTACKS, help=argparse.SUPPRESS)
    parser.add_argument("--hold", type=float, default=0.0, help=argparse.SUPPRESS)
    return parser.parse_args()


def run() -> int:
    args = parse_args()
    if args.with_key:
        HOSTILE_AUTH.append(f"Authorization: Bearer {KEY}")
    if args.grpc_unread_worker:
        small = args.grpc_unread_window == "small"
        run_loop(grpc_unread_worker(args.grpc_unread_worker, args.grpc_unread, small))
        return 0
    if args.hostile_worker:
        run_loop(hostile_worker(args.hostile_worker, args.hostile, args.kinds, limits_of(args)))
        return 0
    if args.attack_worker:
        run_loop(attack_worker(args.attack_worker, args.attack, args.hostile, args.hold))
        return 0
    result = run_loop(until_signal(main(args)))
    print(table(result))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(f"wrote {args.out}")
    return 0 if all(result["goals"].values()) else 1


if __name__ == "__main__":
    sys.exit(run())
