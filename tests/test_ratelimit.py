"""Tenants' limits (proxy/ratelimit.py) on an injected clock: each limit's 429, its
headers and retry-after, reserve-and-settle, two replicas sharing counts through a real
Redis, and a Redis that cannot be reached (a closed port; a connection cut mid-run)."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import pytest
from prometheus_client import CollectorRegistry, Gauge

from proxy.ratelimit import (
    LEASE_S,
    Limiter,
    RateLimited,
    duration,
    sliding,
    wait_s,
)
from proxy.redis_reports import connect
from proxy.settings import RedisSettings
from proxy.tenants import Tenant
from tests.procs import free_ports
from tests.redisenv import REDIS_URL

pytestmark = pytest.mark.timeout(20)

T0 = 1_800_000_000.0  # the start of a minute


class Clock:
    def __init__(self, now: float = T0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def tenant(**limits: int) -> Tenant:
    return Tenant("acme", ["h"], "standard", **limits)


async def refused(limiter: Limiter, t: Tenant, tokens: int = 0) -> RateLimited:
    with pytest.raises(RateLimited) as caught:
        await limiter.admit(t, tokens)
    assert caught.value.http_status == 429 and caught.value.code == "rate_limited"
    return caught.value


def test_the_sliding_window_estimate_and_its_wait() -> None:
    assert sliding(10, 4, 0.25) == 11.5
    assert wait_s(0, 3, 1, 3, 0.0, 60) == pytest.approx(80)  # 3 of 3 now: 2 fade to fit 1
    assert wait_s(6, 0, 1, 3, 0.5, 60) == pytest.approx(10)  # 6 x (1 - f) <= 2 at f = 2/3
    assert wait_s(0, 0, 3, 3, 0.7, 60) == 0
    assert [duration(s) for s in (0.02, 1, 61, 3725.2)] == ["20ms", "1s", "1m1s", "1h2m6s"]


async def test_requests_per_minute_429_with_headers_and_retry_after() -> None:
    clock = Clock()
    limiter = Limiter(clock=clock)
    t = tenant(requests_per_minute=3)
    first = await limiter.admit(t, 0)
    assert first.headers == {
        "x-ratelimit-limit-requests": "3",
        "x-ratelimit-remaining-requests": "2",
        "x-ratelimit-reset-requests": "2m0s",
    }
    for _ in range(2):
        (await limiter.admit(t, 0)).settle(0)
    over = await refused(limiter, t)
    assert "3 requests per minute" in over.message
    assert over.retry_after_s == 80  # two of the three must fade out of the next minute
    assert over.headers["x-ratelimit-remaining-requests"] == "0"
    clock.now = T0 + 79.5
    await refused(limiter, t)
    clock.now = T0 + 80.5
    await limiter.admit(t, 0)


async def test_tokens_are_reserved_then_settled_to_what_was_used() -> None:
    clock = Clock()
    limiter = Limiter(clock=clock)
    t = tenant(tokens_per_minute=1000)
    big = await limiter.admit(t, 900)
    assert big.headers["x-ratelimit-remaining-tokens"] == "100"
    over = await refused(limiter, t, 200)  # 900 reserved + 200 > 1000
    assert "1000 tokens per minute" in over.message
    big.settle(150)  # it used far less than reserved
    assert limiter.local_counts("acme").tpm == (0, 150)
    big.settle(10_000)  # settled once only
    assert limiter.local_counts("acme").tpm == (0, 150)
    await limiter.admit(t, 800)
    # a max_tokens larger than the limit alone reserves the whole limit, no more
    clock.now = T0 + 200
    whole = await limiter.admit(t, 50_000)
    assert whole.tokens == 1000
    whole.settle(None)  # nothing known: the estimate stands
    assert limiter.local_counts("acme").tpm == (0, 1000)


async def test_tokens_per_day() -> None:
    clock = Clock()
    limiter = Limiter(clock=clock)
    t = tenant(tokens_per_day=500)
    (await limiter.admit(t, 400)).settle(450)
    over = await refused(limiter, t, 100)
    assert "500 tokens per day" in over.message
    assert over.retry_after_s > 3600  # a day-long window frees slowly
    clock.now += 86_400 * 2
    await limiter.admit(t, 100)


async def test_max_concurrent_frees_a_slot_on_settle() -> None:
    limiter = Limiter(clock=Clock())
    t = tenant(max_concurrent=2)
    a = await limiter.admit(t, 0)
    await limiter.admit(t, 0)
    over = await refused(limiter, t)
    assert "2 requests at once" in over.message and over.retry_after_s == 1
    a.settle(0)
    await limiter.admit(t, 0)


async def test_a_tenant_without_limits_counts_nothing() -> None:
    limiter = Limiter(clock=Clock())
    r = await limiter.admit(tenant(), 10_000)
    assert (r.tokens, r.headers) == (0, {})


# -- Redis ---------------------------------------------------------------------------


def shared_limiter(cluster: str, clock: Clock, url: str = REDIS_URL, **kw: object) -> Limiter:
    settings = RedisSettings(url=url, cluster=cluster, timeout_s=0.5)
    registry = CollectorRegistry()
    gauge = Gauge("shared", "", registry=registry)
    return Limiter(connect(settings), settings, clock=clock, shared_gauge=gauge, **kw)  # type: ignore[arg-type]


async def test_two_replicas_share_counts_through_redis(cluster: str) -> None:
    clock = Clock()
    a, b = shared_limiter(cluster, clock), shared_limiter(cluster, clock)
    t = tenant(requests_per_minute=5, tokens_per_minute=1000, max_concurrent=3)
    try:
        ra = await a.admit(t, 400)
        rb = await b.admit(t, 400)
        assert rb.shared and rb.headers["x-ratelimit-remaining-tokens"] == "200"
        over = await refused(a, t, 400)  # 800 of 1000 tokens taken, across both replicas
        assert "tokens per minute" in over.message
        ra.settle(100)  # A's request used 100: B now sees room for 400 more
        await a.close()
        await b.admit(t, 400)
        await a.admit(t, 0)
        over = await refused(b, t, 0)  # rb and the two new ones in flight (ra's slot is back)
        assert "3 requests at once" in over.message
        rb.settle(400)
        await b.close()
        await a.admit(t, 0)
        over = await refused(b, t, 0)  # the sixth request this minute
        assert "5 requests per minute" in over.message
    finally:
        await a._redis.aclose()  # type: ignore[union-attr]
        await b._redis.aclose()  # type: ignore[union-attr]


async def test_a_replica_that_dies_frees_its_slots_when_the_lease_ends(cluster: str) -> None:
    clock = Clock()
    a, b = shared_limiter(cluster, clock), shared_limiter(cluster, clock)
    t = tenant(max_concurrent=1)
    try:
        await a.admit(t, 0)  # never settled: A "died"
        await refused(b, t)
        clock.now += LEASE_S + 1
        await b.admit(t, 0)
    finally:
        await a._redis.aclose()  # type: ignore[union-attr]
        await b._redis.aclose()  # type: ignore[union-attr]


async def test_redis_unreachable_each_replica_enforces_its_share(
    caplog: pytest.LogCaptureFixture,
) -> None:
    (port,) = free_ports(1)  # nothing listens there
    clock = Clock()
    limiter = shared_limiter("closed", clock, url=f"redis://127.0.0.1:{port}/0", replicas=2)
    t = tenant(requests_per_minute=10)
    try:
        for _ in range(5):
            r = await limiter.admit(t, 0)
            assert not r.shared
        over = await refused(limiter, t)
        assert "this replica's share: 5" in over.message
        assert over.headers["x-ratelimit-limit-requests"] == "5"
        assert not limiter.shared and limiter._gauge is not None
        assert limiter._gauge._value.get() == 0  # type: ignore[attr-defined]
        assert "each tenant limit is enforced here at 0.5 of it (2 replicas)" in caplog.text
    finally:
        await limiter._redis.aclose()  # type: ignore[union-attr]


class Cut:
    """A TCP relay to the real Redis that the test can cut (and restore), so that one
    limiter loses Redis without the shared server stopping."""

    def __init__(self) -> None:
        self.server: asyncio.Server | None = None
        self.port = 0
        self._writers: list[asyncio.StreamWriter] = []

    async def start(self, port: int = 0) -> None:
        self.server = await asyncio.start_server(self._relay, "127.0.0.1", port)
        self.port = self.server.sockets[0].getsockname()[1]

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", 6379)
        self._writers += [writer, up_writer]

        async def pipe(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            with contextlib.suppress(OSError):
                while data := await r.read(65536):
                    w.write(data)
                    await w.drain()
            w.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    async def cut(self) -> None:
        assert self.server is not None
        self.server.close()
        for w in self._writers:
            w.close()
        await self.server.wait_closed()
        self._writers = []


async def test_redis_lost_mid_run_then_back(cluster: str, caplog: pytest.LogCaptureFixture) -> None:
    if not REDIS_URL.startswith("redis://127.0.0.1:6379"):
        pytest.skip("the relay goes to 127.0.0.1:6379")
    relay = Cut()
    await relay.start()
    clock = Clock()
    a = shared_limiter(cluster, clock, url=f"redis://127.0.0.1:{relay.port}/0")
    b = shared_limiter(cluster, clock)
    t = tenant(requests_per_minute=8)
    try:
        await a.refresh()
        await b.refresh()
        await a.refresh()
        assert (a.replicas, b.replicas) == (2, 2)  # each learnt the other is there
        for _ in range(2):
            await a.admit(t, 0)
        await relay.cut()
        caplog.set_level(logging.WARNING)
        # A alone now: 8 / 2 replicas = 4, of which its own 2 requests are counted already
        for _ in range(2):
            assert not (await a.admit(t, 0)).shared
        over = await refused(a, t)
        assert "this replica's share: 4" in over.message
        assert "Redis" in caplog.text and "unreachable" in caplog.text
        # B still shares through Redis: A's two shared requests count, its local two not
        for _ in range(6):
            await b.admit(t, 0)
        await refused(b, t)
        await relay.start(relay.port)  # Redis is back for A
        await a.refresh()
        assert a.shared
        over = await refused(a, t)  # back on the shared count: 8 of 8
        assert "share" not in over.message
    finally:
        await a._redis.aclose()  # type: ignore[union-attr]
        await b._redis.aclose()  # type: ignore[union-attr]
        with contextlib.suppress(Exception):
            await relay.cut()


async def test_a_slot_freed_while_redis_was_away_is_freed_there_when_it_is_back(
    cluster: str,
) -> None:
    if not REDIS_URL.startswith("redis://127.0.0.1:6379"):
        pytest.skip("the relay goes to 127.0.0.1:6379")
    relay = Cut()
    await relay.start()
    clock = Clock()
    a = shared_limiter(cluster, clock, url=f"redis://127.0.0.1:{relay.port}/0")
    b = shared_limiter(cluster, clock)
    t = tenant(max_concurrent=1)
    try:
        held = await a.admit(t, 0)
        assert held.shared
        await relay.cut()
        await a.refresh()  # finds Redis gone
        held.settle(0)  # the request ends while A cannot tell Redis
        await refused(b, t)  # Redis still counts A's request in flight
        await relay.start(relay.port)
        await a.refresh()  # back: the settlement goes out
        await b.admit(t, 0)
    finally:
        await a._redis.aclose()  # type: ignore[union-attr]
        await b._redis.aclose()  # type: ignore[union-attr]
        with contextlib.suppress(Exception):
            await relay.cut()


async def test_without_redis_each_of_n_replicas_enforces_its_share() -> None:
    limiter = Limiter(clock=Clock(), replicas=4)
    t = tenant(requests_per_minute=8)
    for _ in range(2):
        await limiter.admit(t, 0)
    over = await refused(limiter, t)
    assert "this replica's share: 2" in over.message
