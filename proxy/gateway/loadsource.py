"""Keeping the router's view of unit load current.

``watch`` (default) and ``watch-http``: one held stream of reports per unit, as a
gRPC WatchLoad stream, or as server-sent events from GET /load/watch on the gateway's
own HTTP client. The sidecar pushes a report on every change and a heartbeat every
interval. A broken stream means the sidecar is gone or restarting: the unit gets no
new requests until it reports again, and the stream is re-opened with exponential
backoff and jitter. Measured in bench/overhead: over HTTP, non-streamed requests cost
the gateway about 7 % less CPU (no gRPC traffic, no grpcio poller thread, on the HTTP
path), but SSE streams at saturation went about 15 % slower, so gRPC stays the default
for small fleets; above ``watch_grpc_max_units`` units ``watch`` reads over HTTP (per
report, an HTTP stream costs about half the CPU of a gRPC one in bench/scale).
``poll``: GET /load every interval.
``redis``: one subscription to the cluster's load channel for every unit; units that
register in Redis are discovered and routed to (see ``RedisSource``).
Each can delay each report on purpose (``report_delay_s``) for benchmarks.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable
from typing import Any

import grpc
from redis.asyncio import Redis
from redis.asyncio.client import PubSub
from redis.exceptions import ConnectionError as RedisConnectionError

from proxy.gateway.http1.pool import Pool, UpstreamError
from proxy.gateway.rates import report_rates, scaled
from proxy.gateway.router import Router
from proxy.gateway.units import Unit
from proxy.jsonio import loads
from proxy.load import LoadReport, PrefixBlocks
from proxy.pb.unitproxy.v1 import load_pb2, load_pb2_grpc
from proxy.redis_reports import REDIS_ERRORS, Keys, Outage, connect
from proxy.settings import RedisSettings, UnitTarget

log = logging.getLogger(__name__)

BACKOFF_S = (0.05, 2.0)  # first and longest wait before reconnecting
ASK_EVERY_S = 10.0  # a Redis gateway renews the report interval it asks for this often
ASK_TTL_MS = 30_000  # ... which lapses this long after the last gateway asked
MAX_REPORT_BYTES = 1 << 20  # an SSE event longer than this is not a load report


class LoadSource:
    def __init__(self, router: Router, rng: random.Random | None = None):
        self._router = router
        self._rng = rng or random.Random()
        self._delay_s = router.settings.report_delay_s
        # How often to ask each unit for reports (proxy.gateway.rates).
        self._rates = report_rates(router.settings, len(router.units))

    def _deliver(self, unit: Unit, report: LoadReport, blocks: PrefixBlocks | None = None) -> None:
        if self._delay_s > 0:
            loop = asyncio.get_running_loop()
            loop.call_later(self._delay_s, self._router.apply_report, unit.id, report, blocks)
        else:
            self._router.apply_report(unit.id, report, blocks)

    async def _backoff(self, attempt: int) -> None:
        first, most = BACKOFF_S
        await asyncio.sleep(min(first * 2**attempt, most) * self._rng.uniform(0.5, 1.0))


class WatchSource(LoadSource):
    def __init__(
        self,
        router: Router,
        channel_for: Callable[[Unit], grpc.aio.Channel],
        rng: random.Random | None = None,
    ):
        super().__init__(router, rng)
        self._channel_for = channel_for

    async def run(self, unit: Unit) -> None:
        stub = load_pb2_grpc.LoadReportingStub(self._channel_for(unit))
        attempt = 0
        while True:
            try:
                received = await self._hold(unit, stub)
                why = "load stream ended"
            except grpc.aio.AioRpcError as exc:
                received, why = False, f"load stream broke: {exc.code().name}: {exc.details()}"
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("load watch of unit %s failed unexpectedly", unit.id)
                received, why = False, "load watch failed"
            self._router.forget_report(unit.id, why)
            attempt = 0 if received else attempt + 1
            await self._backoff(attempt)

    async def _hold(self, unit: Unit, stub: load_pb2_grpc.LoadReportingStub) -> bool:
        rates = self._rates
        asked = load_pb2.WatchLoadRequest(
            min_interval_ms=rates.min_interval_ms,
            heartbeat_ms=rates.heartbeat_ms,
            watcher=self._router.name,
        )
        call = stub.WatchLoad(asked)
        received = False
        try:
            async for msg in call:
                received = True
                self._deliver(unit, *LoadReport.read_pb(msg))
        finally:
            call.cancel()
        return received


class HttpWatchSource(LoadSource):
    """WatchLoad's reports as server-sent events from the unit's ``GET /load/watch``,
    read on the gateway's own HTTP client: no gRPC traffic while serving HTTP."""

    def __init__(
        self,
        router: Router,
        pool_for: Callable[[Unit], Pool],
        quiet_s: float,
        rng: random.Random | None = None,
    ):
        super().__init__(router, rng)
        self._pool_for = pool_for
        self._quiet_s = quiet_s  # no report (heartbeats included) for this long: reconnect
        self._quiet = _Quiet(quiet_s)
        rates = self._rates
        self._path = f"/load/watch?watcher={router.name}" + (
            f"&min_interval_ms={rates.min_interval_ms}&heartbeat_ms={rates.heartbeat_ms}"
            if rates.min_interval_s or rates.heartbeat_s
            else ""
        )

    async def run(self, unit: Unit) -> None:
        attempt = 0
        while True:
            received = _Received()
            try:
                await self._hold(unit, received)
                why = "load stream ended"
            except (UpstreamError, TimeoutError, ValueError) as exc:
                why = f"load stream broke: {exc or type(exc).__name__}"
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("load watch of unit %s failed unexpectedly", unit.id)
                why = "load watch failed"
            self._router.forget_report(unit.id, why)
            attempt = 0 if received.any else attempt + 1
            await self._backoff(attempt)

    async def _hold(self, unit: Unit, received: _Received) -> None:
        async with asyncio.timeout(self._quiet_s):
            conn = await self._pool_for(unit).request(b"GET", self._path, {})
        try:
            if conn.status != 200:
                raise ValueError(f"GET /load/watch answered {conn.status}")
            events = _Events(unit, self._deliver, received, conn.close)
            self._quiet.add(received, conn.close)
            try:
                await conn.splice(events.feed)
            except UpstreamError:
                if not received.quiet:
                    raise
            finally:
                self._quiet.remove(received)
            if received.quiet:
                raise TimeoutError(f"no report for {self._quiet_s:g} s")
        finally:
            conn.close()  # never reused


def loop_time() -> float:
    return asyncio.get_running_loop().time()


class _Received:
    def __init__(self) -> None:
        self.any = False
        self.at = loop_time()
        self.quiet = False  # closed for sending nothing for too long


class _Quiet:
    """Closes a watch stream whose unit sent nothing, heartbeats included, for quiet_s:
    one timer looks over every held stream an eighth of that apart (a stream is closed
    quiet_s to 1.125 quiet_s after its last report), rather than a timer and a waiting
    task a stream (thousands of units)."""

    def __init__(self, quiet_s: float) -> None:
        self._quiet_s = quiet_s
        self._held: dict[_Received, Callable[[], None]] = {}
        self._timer: asyncio.TimerHandle | None = None

    def add(self, received: _Received, close: Callable[[], None]) -> None:
        self._held[received] = close
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self._quiet_s / 8, self._look)

    def remove(self, received: _Received) -> None:
        self._held.pop(received, None)
        if not self._held and self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _look(self) -> None:
        since = loop_time() - self._quiet_s
        quiet = [received for received in self._held if received.at <= since]
        closes = [self._held.pop(received) for received in quiet]
        self._timer = (  # first: a close that raised would leave the others unwatched
            asyncio.get_running_loop().call_later(self._quiet_s / 8, self._look)
            if self._held
            else None
        )
        for received, close in zip(quiet, closes, strict=True):
            received.quiet = True
            close()


class _Events:
    """Splits the SSE byte stream into reports and delivers each; a report that cannot
    be read closes the stream (it is re-opened with backoff)."""

    def __init__(
        self,
        unit: Unit,
        deliver: Callable[[Unit, LoadReport, PrefixBlocks | None], None],
        received: _Received,
        close: Callable[[], None],
    ):
        self._unit = unit
        self._deliver = deliver
        self._received = received
        self._close = close
        self._buf = b""

    def feed(self, data: bytes) -> None:
        self._received.at = loop_time()
        *events, self._buf = (self._buf + data).split(b"\n\n")
        for event in events:
            if not event.startswith(b"data: "):
                continue
            try:
                report, blocks = LoadReport.read_dict(loads(event[6:]))
            except (ValueError, TypeError, KeyError) as exc:
                log.warning(
                    "unit %s sent a load report that cannot be read: %s", self._unit.id, exc
                )
                self._close()
                return
            self._received.any = True
            self._deliver(self._unit, report, blocks)
        if len(self._buf) > MAX_REPORT_BYTES:
            log.warning("unit %s sent a load report over %d bytes", self._unit.id, MAX_REPORT_BYTES)
            self._close()


class PollSource(LoadSource):
    """GET /load every poll interval, on the gateway's own HTTP client: one kept-alive
    connection per unit, apart from the requests' (``new_pool`` makes it)."""

    def __init__(
        self, router: Router, new_pool: Callable[[Unit], Pool], rng: random.Random | None = None
    ):
        super().__init__(router, rng)
        self._new_pool = new_pool
        self._interval_s = router.settings.poll_interval_s
        self._blocks: dict[str, tuple[int, int]] = {}  # unit -> (epoch, seq) read last

    async def run(self, unit: Unit) -> None:
        pool = self._new_pool(unit)
        try:
            while True:
                try:
                    await self._poll(unit, pool)
                except asyncio.CancelledError:
                    raise
                except (UpstreamError, TimeoutError, ValueError, TypeError, KeyError) as exc:
                    # Its last report ages out; the unit shows LOST with this reason.
                    why = str(exc) or type(exc).__name__
                    self._router.unreachable(unit, f"polling /load failed: {why}")
                except Exception:
                    log.exception("polling unit %s failed unexpectedly", unit.id)
                await asyncio.sleep(self._interval_s * self._rng.uniform(0.9, 1.1))
        finally:
            await pool.close()

    async def _poll(self, unit: Unit, pool: Pool) -> None:
        # The prefix blocks' changes since the last report read (the whole set first,
        # and whenever the unit no longer has those changes).
        since = self._blocks.get(unit.id)
        path = f"/load?watcher={self._router.name}" + (
            "" if since is None else f"&blocks_epoch={since[0]}&blocks_since={since[1]}"
        )
        async with asyncio.timeout(self._interval_s):
            conn = await pool.request(b"GET", path, {})
            try:
                body = await conn.read()
            finally:
                conn.done()
        if conn.status != 200:
            raise ValueError(f"GET /load answered {conn.status}")
        report, blocks = LoadReport.read_dict(loads(body))
        if blocks is not None:
            self._blocks[unit.id] = blocks.epoch, blocks.seq
        self._deliver(unit, report, blocks)


class RedisSource(LoadSource):
    """Reports of every unit from Redis (docs/api.md, Load report): SUBSCRIBE to the load channel,
    then re-read every unit's key, on each (re)connect, so nothing is missed.

    A report from a unit this gateway does not know adds it (``discover`` opens its
    clients). A unit that stops reporting is no longer routed once its last report is
    older than the router's ``stale_after_s`` (its key expires after 3 report
    intervals). While Redis itself is down, reports stop aging (``Router.pause_aging``):
    every unit is routed on what was last known plus this gateway's own counts, and
    passive health ejects one that fails; once Redis is back and every key is re-read,
    reports age again from where they stopped.
    """

    def __init__(
        self,
        router: Router,
        settings: RedisSettings,
        discover: Callable[[UnitTarget], Unit | None],
        rng: random.Random | None = None,
    ):
        super().__init__(router, rng)
        self._settings = settings
        self._keys = Keys(settings.cluster)
        self._discover = discover
        self._outage = Outage("gateway load source", settings, self._rng)
        self._configured = router.settings  # before any stretching by fleet size
        self._refused: set[str] = set()  # unit ids whose addresses could not be used
        self._unreadable = 0  # reports that could not be parsed (the first is logged)
        self.connects = 0  # successful (re)connects, each with a full re-read
        # Prefix blocks: each unit's (epoch, seq) as of the last message, and the units
        # whose key (the whole set) is being re-read after a message that did not follow.
        self._blocks: dict[str, tuple[int, int]] = {}
        self._resyncing: set[str] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self.resyncs = 0
        self._redis: Redis | None = None

    async def run(self) -> None:
        redis = self._redis = connect(self._settings)
        try:
            while True:
                try:
                    await self._follow(redis)
                except asyncio.CancelledError:
                    raise
                except REDIS_ERRORS as exc:
                    self._lost(exc)
                except Exception as unexpected:
                    log.exception("reading load reports from Redis failed unexpectedly")
                    self._lost(unexpected)
                await self._outage.backoff()
        finally:
            for task in self._tasks:
                task.cancel()
            await redis.aclose()

    def _lost(self, exc: BaseException) -> None:
        self._router.pause_aging()
        self._outage.failed(exc, "routing on the last reports and this gateway's own counts")

    async def _follow(self, redis: Redis) -> None:
        async with redis.pubsub() as pubsub:
            async with asyncio.timeout(self._settings.timeout_s):
                await pubsub.subscribe(self._keys.channel)
            # Subscribed first: a report published during the re-read is not lost.
            await self._reread(redis)
            self.connects += 1
            self._outage.recovered()
            self._router.resume_aging()
            await self._listen(pubsub, redis)

    async def _ask(self, redis: Redis) -> None:
        """Ask every sidecar for a report at most (and a heartbeat at least) every
        N / report_budget_per_s s, N the units known (discovered ones too), and stretch
        the router's staleness bound to match, as ``scaled`` does for configured units."""
        units = len(self._router.units)
        rates = report_rates(self._configured, units)
        each_s = max(rates.min_interval_s, rates.heartbeat_s)
        self._router.settings = scaled(self._configured, units)
        if each_s > 0:
            async with asyncio.timeout(self._settings.timeout_s):
                await redis.set(self._keys.asked, round(each_s * 1000), px=ASK_TTL_MS)

    async def _reread(self, redis: Redis) -> None:
        keys = self._keys
        async with asyncio.timeout(self._settings.timeout_s * 2):
            ids = sorted(_text(i) for i in await redis.smembers(keys.units))
            values = await redis.mget([keys.unit(i) for i in ids]) if ids else []
        gone = [unit_id for unit_id, value in zip(ids, values, strict=True) if value is None]
        for value in values:
            if value is not None:
                self._receive(_text(value))
        # A unit whose key is gone keeps its last report, which ages out within
        # stale_after_s: a Redis that restarted empty has no key until each sidecar
        # reconnects, and those units must not drop out meanwhile. The set keeps only
        # units that report; each publish adds its unit again.
        if gone:
            async with asyncio.timeout(self._settings.timeout_s):
                await redis.srem(keys.units, *gone)

    async def _listen(self, pubsub: PubSub, redis: Redis) -> None:
        # Quiet for one timeout: PING; quiet for another: the connection is dead
        # (a closed one raises at once; this catches one that hangs). Any message is a
        # sign of life, the answer to PING included, whatever form the client gives it.
        timeout = self._settings.timeout_s
        pinged = False
        loop = asyncio.get_running_loop()
        ask_at = loop.time()
        while True:
            if loop.time() >= ask_at:
                await self._ask(redis)
                ask_at = loop.time() + ASK_EVERY_S
            message: dict[str, Any] | None = await pubsub.get_message(timeout=timeout)
            if message is None:
                if pinged:
                    raise RedisConnectionError(f"no answer to PING within {timeout:g} s")
                await pubsub.ping()
                pinged = True
                continue
            pinged = False
            if message["type"] == "message":
                self._receive(message["data"])

    def _receive(self, data: str) -> None:
        try:
            report, blocks = LoadReport.read_dict(loads(data))
        except (ValueError, TypeError, KeyError) as exc:
            level = logging.DEBUG if self._unreadable else logging.WARNING
            self._unreadable += 1
            log.log(level, "ignoring a load report in Redis that cannot be read: %s", exc)
            return
        unit = self._router.units.get(report.unit_id) or self._new_unit(report)
        if unit is not None:
            self._follow_blocks(report.unit_id, blocks)
            self._deliver(unit, report, blocks)

    def _follow_blocks(self, unit_id: str, blocks: PrefixBlocks | None) -> None:
        """A message whose prefix blocks do not follow on the last one read (one was
        missed): re-read the unit's key, which holds the whole set."""
        if blocks is None:
            return
        at = self._blocks.get(unit_id)
        if blocks.full or at == (blocks.epoch, blocks.from_seq):
            self._blocks[unit_id] = blocks.epoch, blocks.seq
        elif unit_id not in self._resyncing and self._redis is not None:
            self._resyncing.add(unit_id)
            task = asyncio.get_running_loop().create_task(self._resync(self._redis, unit_id))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _resync(self, redis: Redis, unit_id: str) -> None:
        try:
            async with asyncio.timeout(self._settings.timeout_s):
                value = await redis.get(self._keys.unit(unit_id))
            self.resyncs += 1
            if value is not None:
                self._receive(_text(value))
        except REDIS_ERRORS as exc:
            log.debug("re-reading unit %s's prefix blocks from Redis failed: %s", unit_id, exc)
        finally:
            self._resyncing.discard(unit_id)

    def _new_unit(self, report: LoadReport) -> Unit | None:
        spec = f"{report.unit_id}={report.http_url},{report.grpc_target}"
        try:
            target = UnitTarget.parse(spec)
        except ValueError as exc:
            if report.unit_id not in self._refused and len(self._refused) < 1024:
                self._refused.add(report.unit_id)
                log.warning("unit %s registered in Redis cannot be routed to: %s",
                            report.unit_id, exc)  # fmt: skip
            return None
        unit = self._discover(target)
        if unit is not None:
            log.info("unit %s discovered in Redis: HTTP %s, gRPC %s",
                     target.id, target.http_url, target.grpc_target)  # fmt: skip
        return unit


def _text(value: bytes | str) -> str:
    # The client decodes responses; its types allow bytes too.
    return value if isinstance(value, str) else value.decode()
