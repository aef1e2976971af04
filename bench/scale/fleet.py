"""A fleet emulator: one process hosting hundreds to thousands of light units.

Each unit speaks the real protocols a gateway reads load from, with the sidecar's own
code where it can: a gRPC server of its own with LoadReporting (WatchLoad through
``proxy.sidecar.watch.ReportWatch``: the current report at once, one per change
coalesced, a heartbeat every interval), an HTTP port with ``GET /load`` and
``GET /load/watch`` (server-sent events), or reports published to Redis as sidecars
publish them (``SET unit:{id}`` with a TTL, ``SADD units``, ``PUBLISH load``: one
message per report on the one channel, many units' commands in one pipeline). Its HTTP
port also answers ``POST /v1/completions`` and ``/v1/chat/completions`` (a short
stream of a few chunks, or one JSON body), counted in the unit's outstanding, so
requests can be routed through a gateway to the fleet.

Load moves like a loaded fleet's: each unit has a capacity and a mean request duration
(units differ, 0.75-1.5x), requests arrive at random (Poisson) at ``utilization`` of
what the unit can finish and each finishes at random (exponential durations, as a
continuous batcher's mix of output lengths looks from outside). The model is lazy, so
that the process has its cores for the units' reports and streams however large the
fleet: a unit's outstanding is drawn only when a report is made, from the exact law
of that queue (M/M/infinity) over the time since the last draw, clipped to the
capacity (``Fleet.draw``); after each report one change is scheduled at the time the
queue's next event would come (exponential, at the unit's event rate: memoryless, so
the first change a watch sees after its report comes when it would have with every
event played), and that change notifies the unit's watchers. A watch folds changes
into its next report at the interval it asked for, exactly as a sidecar's does.
``GET /stats`` on the control port says how many reports went out (and their bytes,
as the wire carries them: protobuf for gRPC, JSON otherwise), how many changes were
notified, and how many events the model stands for (``events``: the expected arrivals
and finishes between draws, summed).

Prefix blocks (``--chunks-per-request N``, 0 by default: none): each unit then reports
the prefix blocks its engine holds as a sidecar does, with the sidecar's own change
stream (``proxy.sidecar.blocks.HeldChunks``: whole set first, then the changes since
what each reader holds, a resync after a gap). Its engine starts full
(``--held-blocks`` chunks) and stores N new chunks per request that arrives (the part
of a prompt not yet cached), each past the bound evicting the oldest: at steady state
2N changes per request. Chunks are random (no two units share one), the worst case
for the gateway's map from block to units.

    .venv/bin/python -m bench.scale.fleet --units 1000 --source watch --ready-file f.json

The ready file (JSON) lists every unit's id, HTTP URL and gRPC target, and the control
URL; the process runs until SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import heapq
import json
import math
import os
import random
import socket
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import grpc
from aiohttp import web

from bench.common import Interrupted, run_loop, until_signal
from proxy.broadcast import Broadcast
from proxy.load import LoadReport, NodeStatus, UnitState
from proxy.pb.unitproxy.v1 import load_pb2, load_pb2_grpc
from proxy.redis_reports import Keys, asked_s
from proxy.sidecar.blocks import HeldChunks
from proxy.sidecar.watch import ReportWatch

HOST = "127.0.0.1"
SOURCES = ("watch", "watch-http", "poll", "redis")
REDIS_BATCH = 500  # units' commands per pipeline


class _Health:
    def __init__(self) -> None:
        self.state_changes = Broadcast()


class EmulatedHeld(HeldChunks):
    """A unit's held chunks, moved by requests' stores instead of an engine's events."""

    def store(self, rng: random.Random, n: int) -> None:
        # Past max_blocks stores the whole set is new: the stores before the last
        # max_blocks are evicted again before anyone reads them. They are numbered (2
        # changes each) but not played, and the log is emptied, so that a reader from
        # before gets the whole set, as from a sidecar whose log they overran.
        skipped = max(0, n - self.max_blocks)
        if skipped:
            self.seq += 2 * skipped
            self._log.clear()
        for _ in range(n - skipped):
            self._add(rng.getrandbits(60))  # as proxy.prefix_chunks names chunks


class EmulatedUnit:
    """One unit: its load as the fleet's arrays say, its reports, its watchers."""

    def __init__(self, fleet: Fleet, index: int, unit_id: str):
        self.fleet = fleet
        self.index = index
        self.id = unit_id
        self.http_url = ""
        self.grpc_target = ""
        self.health = _Health()
        self.changes = Broadcast()
        self.serving_now = 0  # requests the HTTP port is answering
        self._seq = 0
        self.held: EmulatedHeld | None = None
        self.blocks_at = 0.0  # when the held chunks were last moved
        self.redis_since: tuple[int, int] | None = None  # the Redis channel's reader
        if fleet.chunks_per_request > 0:
            self.held = EmulatedHeld(fleet.chunk_chars, fleet.held_blocks, fleet.rng)
            self.held.store(fleet.rng, fleet.held_blocks)
            self.blocks_at = fleet.clock()
        started = int(time.time() * 1000)
        self.nodes = (
            NodeStatus(f"{unit_id}-leader", "leader", "", True, "", started),
            NodeStatus(f"{unit_id}-follower-0", "follower", "", True, "", started),
        )

    def changed(self) -> None:
        """Its load changed: its watchers' next report says so, and the Redis publisher's."""
        self.changes.notify()
        if self.fleet.changed is not None:
            self.fleet.changed.add(self.index)

    def report(
        self, blocks_since: tuple[int, int] | None = None, watcher: str | None = None
    ) -> LoadReport:
        self._seq += 1
        f, i = self.fleet, self.index
        now = f.clock()
        outstanding = f.draw(i, now) + self.serving_now
        f.schedule_change(i, now)
        running = min(outstanding, f.slots)
        blocks = None
        held = self.held
        if held is not None:
            # the chunks stored by the requests that arrived since the last report
            arrived = poisson(f.rng, f.arrival_rate[i] * (now - self.blocks_at))
            self.blocks_at = now
            held.store(f.rng, arrived * f.chunks_per_request)
            blocks = held.full() if blocks_since is None else held.delta(*blocks_since)
        return LoadReport(
            unit_id=self.id,
            state=UnitState.SERVING,
            outstanding=outstanding,
            capacity=f.capacity,
            running=running,
            waiting=outstanding - running,
            kv_cache_usage=round(running / f.slots, 3),
            nodes=self.nodes,
            seq=self._seq,
            timestamp_ms=int(time.time() * 1000),
            http_url=self.http_url,
            grpc_target=self.grpc_target,
            prefix_blocks=blocks,
        )


class Fleet:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        n = args.units
        self.capacity = args.capacity
        self.slots = max(1, args.capacity // 4)
        self.coalesce_s = args.coalesce_ms / 1000
        self.interval_s = args.report_interval_s
        self.rng = random.Random(args.seed)
        rng = self.rng
        self.chunks_per_request = args.chunks_per_request
        self.held_blocks = args.held_blocks
        self.chunk_chars = args.chunk_chars
        # Mean request duration per unit, 0.75-1.5x the fleet's; arrivals at
        # ``utilization`` of what the unit finishes when it holds ``capacity``.
        self.finish_rate = [1 / (args.duration_s * rng.uniform(0.75, 1.5)) for _ in range(n)]
        self.arrival_rate = [args.utilization * self.capacity * mu for mu in self.finish_rate]
        # each unit starts from the stationary law (Poisson, clipped)
        self.outstanding = [
            min(self.capacity, poisson(rng, lam / mu))
            for lam, mu in zip(self.arrival_rate, self.finish_rate, strict=True)
        ]
        self.clock = time.monotonic  # the draws' and the schedule's clock
        self.drawn_at = [self.clock()] * n  # each unit's last draw
        self._scheduled: list[tuple[float, int]] = []  # (when, unit): next changes, a heap
        self._pending = [False] * n  # whether a unit has a change scheduled
        self.units = [EmulatedUnit(self, i, f"{args.prefix}{i:05d}") for i in range(n)]
        self.by_port: dict[int, EmulatedUnit] = {}
        self.any_change = Broadcast()
        # units changed since the Redis publisher last looked; None: no publisher
        self.changed: set[int] | None = None
        self.stats: dict[str, float] = {
            "reports": 0,
            "report_bytes": 0,  # as the wire carries them (protobuf, or JSON)
            "changes": 0,  # notified to watchers
            "events": 0.0,  # arrivals and finishes the model stands for (expected)
            "draws": 0,
            "late_ticks": 0,
            "requests": 0,
        }

    # --- the load model ---------------------------------------------------------------

    def draw(self, i: int, now: float) -> int:
        """Unit ``i``'s outstanding at ``now``: from ``x`` at the last draw, ``dt``
        earlier, each request still there with odds ``p = exp(-mu dt)`` (binomial) and
        the arrivals since still there Poisson with mean ``lambda / mu (1 - p)``, the
        transient of an M/M/infinity queue; clipped to the capacity (arrivals a full
        unit would refuse), which a queue near its mean, as these are, rarely reaches."""
        dt = now - self.drawn_at[i]
        x0 = self.outstanding[i]
        if dt <= 0:
            return x0
        lam, mu = self.arrival_rate[i], self.finish_rate[i]
        stay = math.exp(-mu * dt)
        x = min(
            self.capacity, binomial(self.rng, x0, stay) + poisson(self.rng, lam / mu * (1 - stay))
        )
        self.outstanding[i], self.drawn_at[i] = x, now
        self.stats["events"] += (lam + mu * (x0 + x) / 2) * dt
        self.stats["draws"] += 1
        return x

    def schedule_change(self, i: int, now: float) -> None:
        """After a report of unit ``i``: its next change, when the queue's next event
        (an arrival or a finish, at rate ``lambda + mu x``) comes; one at a time."""
        if self._pending[i]:
            return
        rate = self.arrival_rate[i] + self.finish_rate[i] * self.outstanding[i]
        self._pending[i] = True
        heapq.heappush(self._scheduled, (now + self.rng.expovariate(rate), i))

    def notify_due(self, now: float) -> None:
        """Every scheduled change that is due notifies its unit's watchers."""
        scheduled, units = self._scheduled, self.units
        changed = False
        while scheduled and scheduled[0][0] <= now:
            _, i = heapq.heappop(scheduled)
            self._pending[i] = False
            units[i].changed()
            changed = True
            self.stats["changes"] += 1
        if changed:
            self.any_change.notify()

    async def run_changes(self) -> None:
        """Notify the due changes every coalescing interval (the sidecar's, 5 ms)."""
        dt = self.coalesce_s
        last = self.clock()
        while True:
            await asyncio.sleep(dt)
            now = self.clock()
            if now - last > 2 * dt:
                self.stats["late_ticks"] += 1
            last = now
            self.notify_due(now)


def binomial(rng: random.Random, n: int, p: float) -> int:
    """A binomial draw: ``n`` coin flips for small ``n``, the normal beyond."""
    if n > 200:
        spread = math.sqrt(n * p * (1 - p))
        return min(n, max(0, round(rng.gauss(n * p, spread))))
    return sum(rng.random() < p for _ in range(n))


def poisson(rng: random.Random, mean: float) -> int:
    """A Poisson draw: Knuth's method for small means, the normal beyond."""
    if mean > 30:
        return max(0, round(rng.gauss(mean, math.sqrt(mean))))
    limit, k, p = math.exp(-mean), 0, rng.random()
    while p > limit:
        k += 1
        p *= rng.random()
    return k


# --- gRPC: one server per unit ------------------------------------------------------


class LoadService(load_pb2_grpc.LoadReportingServicer):
    def __init__(self, unit: EmulatedUnit, watch: ReportWatch):
        self._unit = unit
        self._watch = watch

    async def GetLoad(
        self, request: load_pb2.GetLoadRequest, context: grpc.aio.ServicerContext
    ) -> load_pb2.LoadReport:
        msg = self._unit.report().to_pb()
        self._unit.fleet.stats["report_bytes"] += msg.ByteSize()
        return msg

    async def WatchLoad(
        self, request: load_pb2.WatchLoadRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[load_pb2.LoadReport]:
        stats = self._unit.fleet.stats
        asked = request.min_interval_ms / 1000, request.heartbeat_ms / 1000
        async for report in self._watch.reports(*asked):
            msg = report.to_pb()
            stats["reports"] += 1
            stats["report_bytes"] += msg.ByteSize()
            yield msg


def watch_of(fleet: Fleet, unit: EmulatedUnit) -> ReportWatch:
    return ReportWatch(unit, unit.changes, fleet.interval_s, fleet.coalesce_s)


async def start_grpc(fleet: Fleet, stack: contextlib.AsyncExitStack) -> None:
    for unit in fleet.units:
        server = grpc.aio.server()
        load_pb2_grpc.add_LoadReportingServicer_to_server(
            LoadService(unit, watch_of(fleet, unit)), server
        )
        port = server.add_insecure_port(f"{HOST}:0")
        await server.start()
        stack.push_async_callback(server.stop, 0)
        unit.grpc_target = f"{HOST}:{port}"


# --- HTTP: one port per unit, one app ----------------------------------------------


UNIT = web.AppKey("fleet", Fleet)


def unit_of(request: web.Request) -> EmulatedUnit:
    assert request.transport is not None
    port = request.transport.get_extra_info("sockname")[1]
    return request.app[UNIT].by_port[port]


async def load(request: web.Request) -> web.Response:
    unit = unit_of(request)
    q = request.query
    since = None
    if "blocks_since" in q:  # as a sidecar's /load: the changes since what the reader holds
        since = int(q.get("blocks_epoch", 0)), int(q["blocks_since"])
    body = unit.report(since).to_json().encode()
    unit.fleet.stats["reports"] += 1
    unit.fleet.stats["report_bytes"] += len(body)
    return web.Response(body=body, content_type="application/json")


async def load_watch(request: web.Request) -> web.StreamResponse:
    unit = unit_of(request)
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    stats = unit.fleet.stats
    q = request.query
    asked = int(q.get("min_interval_ms", 0)) / 1000, int(q.get("heartbeat_ms", 0)) / 1000
    with contextlib.suppress(ConnectionResetError):
        async for report in watch_of(unit.fleet, unit).reports(*asked):
            event = b"data: " + report.to_json().encode() + b"\n\n"
            stats["reports"] += 1
            stats["report_bytes"] += len(event)
            await response.write(event)
    return response


async def completions(request: web.Request) -> web.StreamResponse:
    """A few chunks (or one body), ``--chunk-ms`` apart: the unit's share of a request's cost is not
    what bench/scale measures; the gateway's is."""
    unit = unit_of(request)
    body = await request.json()
    unit.serving_now += 1
    unit.changed()
    unit.fleet.stats["requests"] += 1
    chunks = unit.fleet.args.chunks
    gap_s = unit.fleet.args.chunk_ms / 1000
    headers = {"x-unitproxy-unit": unit.id}
    try:
        if not body.get("stream"):
            text = "x" * chunks
            answer = {"id": "cmpl-0", "object": "text_completion", "model": "fleet-emulator",
                      "choices": [{"index": 0, "text": text, "finish_reason": "length"}],
                      "usage": {"prompt_tokens": 1, "completion_tokens": chunks,
                                "total_tokens": chunks + 1}}  # fmt: skip
            return web.json_response(answer, headers=headers)
        response = web.StreamResponse(headers={**headers, "Content-Type": "text/event-stream"})
        await response.prepare(request)
        for k in range(chunks):
            last = k == chunks - 1
            chunk = {"id": "cmpl-0", "object": "text_completion", "model": "fleet-emulator",
                     "choices": [{"index": 0, "text": "x",
                                  "finish_reason": "length" if last else None}]}  # fmt: skip
            await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            if gap_s and not last:
                await asyncio.sleep(gap_s)
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response
    finally:
        unit.serving_now -= 1
        unit.changed()


async def start_http(fleet: Fleet, stack: contextlib.AsyncExitStack) -> None:
    app = web.Application()
    app[UNIT] = fleet
    app.router.add_get("/load", load)
    app.router.add_get("/load/watch", load_watch)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", completions)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
    await runner.setup()
    stack.push_async_callback(runner.cleanup)
    for unit in fleet.units:
        port = await open_site(runner)
        fleet.by_port[port] = unit
        unit.http_url = f"http://{HOST}:{port}"


async def open_site(runner: web.AppRunner) -> int:
    """A listening socket of its own on a free port, served by ``runner``; the port."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((HOST, 0))
    await web.SockSite(runner, sock).start()
    return int(sock.getsockname()[1])


# --- Redis: one pipeline for many units ----------------------------------------------


class RedisSchedule:
    """When each unit publishes next, as a sidecar's publisher decides it: a change at
    most every interval the gateways ask for, a heartbeat at least every
    ``max(interval, asked)``. One sorted schedule (a heap, an entry a unit, stale
    entries skipped), so that a tick costs the units due, not a pass over the fleet."""

    def __init__(self, n: int, interval_s: float):
        self.interval_s = interval_s
        self.asked_s = 0.0
        self.sent_at = [-math.inf] * n
        self.pending = [False] * n  # a change not yet published
        self.due_at = [0.0] * n  # every unit's first report at once
        self._heap = [(0.0, i) for i in range(n)]

    @property
    def heartbeat_s(self) -> float:
        return max(self.interval_s, self.asked_s)

    def ask(self, asked: float) -> None:
        """The gateways ask for another interval: every unit's next report moves."""
        if asked == self.asked_s:
            return
        self.asked_s = asked
        self.due_at = [self._due(i) for i in range(len(self.due_at))]
        self._heap = [(t, i) for i, t in enumerate(self.due_at)]
        heapq.heapify(self._heap)

    def _due(self, i: int) -> float:
        return self.sent_at[i] + (self.asked_s if self.pending[i] else self.heartbeat_s)

    def changed(self, i: int) -> None:
        self.pending[i] = True
        due = self._due(i)
        if due < self.due_at[i]:
            self.due_at[i] = due
            heapq.heappush(self._heap, (due, i))

    def due(self, now: float) -> list[int]:
        """The units whose report is due at ``now``, each marked sent at ``now``."""
        heap, out = self._heap, []
        while heap and heap[0][0] <= now:
            t, i = heapq.heappop(heap)
            if t != self.due_at[i]:
                continue  # moved since
            out.append(i)
            self.sent_at[i], self.pending[i] = now, False
            self.due_at[i] = now + self.heartbeat_s
            heapq.heappush(heap, (self.due_at[i], i))
        return out


async def publish_redis(fleet: Fleet, url: str, cluster: str) -> None:
    """Every tick: one report for each unit that changed or whose heartbeat is due, at
    the interval gateways ask for in Redis, as sidecars publish, with the sidecar's TTL
    (3 report intervals)."""
    from redis.asyncio import Redis

    keys = Keys(cluster)
    redis = Redis.from_url(url, decode_responses=True)
    n = len(fleet.units)
    schedule = RedisSchedule(n, fleet.interval_s)
    changed: set[int] = set()
    fleet.changed = changed
    loop = asyncio.get_running_loop()
    try:
        while True:
            seen = fleet.any_change.version
            schedule.ask(asked_s(await redis.get(keys.asked)))  # as a sidecar's MULTI reads it
            ttl_ms = max(1, round(3 * schedule.heartbeat_s * 1000))
            for i in changed:
                schedule.changed(i)
            changed.clear()
            due = schedule.due(loop.time())
            for start in range(0, len(due), REDIS_BATCH):
                async with redis.pipeline(transaction=False) as pipe:
                    for i in due[start : start + REDIS_BATCH]:
                        unit = fleet.units[i]
                        report = unit.report(unit.redis_since)
                        data = key_data = report.to_json()
                        blocks = report.prefix_blocks
                        if blocks is not None and unit.held is not None:
                            # as a sidecar's publisher: the changes on the channel, the
                            # whole set in the key (for a reader that missed some)
                            unit.redis_since = blocks.epoch, blocks.seq
                            if not blocks.full:
                                whole = dataclasses.replace(report, prefix_blocks=unit.held.full())
                                key_data = whole.to_json()
                        pipe.set(keys.unit(unit.id), key_data, px=ttl_ms)
                        pipe.sadd(keys.units, unit.id)
                        pipe.publish(keys.channel, data)
                        fleet.stats["report_bytes"] += len(data)
                    await pipe.execute()
                fleet.stats["reports"] += min(REDIS_BATCH, len(due) - start)
            await fleet.any_change.wait(seen, fleet.coalesce_s)
            await asyncio.sleep(fleet.coalesce_s)
    finally:
        fleet.changed = None
        with contextlib.suppress(Exception):
            ids = [u.id for u in fleet.units]
            for start in range(0, n, REDIS_BATCH):
                await redis.delete(*[keys.unit(i) for i in ids[start : start + REDIS_BATCH]])
            await redis.delete(keys.units)
        await redis.aclose()


# --- control ---------------------------------------------------------------------------


async def serve_control(fleet: Fleet, stack: contextlib.AsyncExitStack) -> str:
    started = time.monotonic()

    async def stats(request: web.Request) -> web.Response:
        body = {**fleet.stats, "uptime_s": time.monotonic() - started, "pid": os.getpid()}
        return web.json_response(body)

    app = web.Application()
    app.router.add_get("/stats", stats)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    stack.push_async_callback(runner.cleanup)
    return f"http://{HOST}:{await open_site(runner)}"


async def main(args: argparse.Namespace) -> None:
    fleet = Fleet(args)
    async with contextlib.AsyncExitStack() as stack:
        control = await serve_control(fleet, stack)
        await start_http(fleet, stack)
        if args.source == "watch":
            await start_grpc(fleet, stack)
        else:
            for unit in fleet.units:  # never dialled: load comes by HTTP or Redis
                unit.grpc_target = f"{HOST}:1"
        tasks = [asyncio.create_task(fleet.run_changes(), name="changes")]
        if args.source == "redis":
            publisher = publish_redis(fleet, args.redis_url, args.cluster)
            tasks.append(asyncio.create_task(publisher, name="redis"))
        units = [{"id": u.id, "http": u.http_url, "grpc": u.grpc_target} for u in fleet.units]
        ready = {"control": control, "pid": os.getpid(), "source": args.source, "units": units}
        write_ready(args.ready_file, ready)
        try:
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


def write_ready(path: Path, ready: dict[str, object]) -> None:
    """Whole or not at all: the runner reads it as soon as it exists."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(ready))
    tmp.replace(path)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--units", type=int, default=100)
    p.add_argument("--source", choices=SOURCES, default="watch")
    p.add_argument("--ready-file", type=Path, required=True)
    p.add_argument("--prefix", default="u", help="unit ids are PREFIX00000, PREFIX00001, ...")
    p.add_argument("--capacity", type=int, default=64, help="max outstanding per unit")
    p.add_argument("--utilization", type=float, default=0.7, help="of capacity, on average")
    p.add_argument("--duration-s", type=float, default=4.0, help="mean request duration")
    p.add_argument("--coalesce-ms", type=float, default=5.0, help="tick and coalescing")
    p.add_argument("--report-interval-s", type=float, default=1.0, help="heartbeat")
    p.add_argument("--chunks", type=int, default=8, help="chunks per streamed answer")
    p.add_argument("--chunk-ms", type=float, default=0.0, help="pause between two chunks")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--chunks-per-request", type=int, default=0,
                   help="prefix blocks: chunks each arriving request stores (0: no blocks)")  # fmt: skip
    p.add_argument("--held-blocks", type=int, default=4096,
                   help="prefix blocks a unit holds (sidecar.prefix_report_blocks)")  # fmt: skip
    p.add_argument("--chunk-chars", type=int, default=512, help="as gateway.prefix_chunk_chars")
    p.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    p.add_argument("--cluster", default=f"scale-{os.getpid()}")
    return p.parse_args(argv)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt, Interrupted):
        run_loop(until_signal(main(parse_args())))
