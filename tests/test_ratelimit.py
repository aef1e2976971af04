"""Tenants' limits (proxy/ratelimit.py) on an injected clock: each limit's 429, its
headers and retry-after, reserve-and-settle, two replicas sharing counts through a real
Redis, and a Redis that cannot be reached (a closed port; a connection cut mid-run)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Gauge

from proxy.errors import InvalidRequest
from proxy.gateway.tenancy import Admission, Pending, TenantGate
from proxy.metrics import TenantMetrics
from proxy.ratelimit import (
    IDLE_S,
    LEASE_S,
    Limiter,
    RateLimited,
    admitted_pairs,
    duration,
    header_block,
    header_pairs,
    minute_of,
    sliding,
    wait_s,
)
from proxy.redis_reports import connect
from proxy.settings import RedisSettings
from proxy.tenants import Tenant, TenantSource
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


counts = st.floats(min_value=0, max_value=1e13, allow_nan=False)


@given(
    rpm=st.sampled_from([0, 1, 7, 600, 10**12]),
    tpm=st.sampled_from([0, 1, 5_000, 10**12]),
    rp=counts, rc=counts, tp=counts, tc=counts,
    need=st.integers(min_value=0, max_value=10**7),
    frac=st.floats(min_value=0, max_value=0.999999),
)  # fmt: skip
def test_the_head_lines_are_the_header_pairs_written_out(
    rpm: int, tpm: int, rp: float, rc: float, tp: float, tc: float, need: int, frac: float
) -> None:
    """What an HTTP response's head carries (one text) is what the pairs say, in order."""
    t = tenant(requests_per_minute=rpm, tokens_per_minute=tpm)
    pairs = header_pairs(t, rp, rc, tp, tc, need, frac, 1.0, True)
    written = "".join(f"{name}: {value}\r\n" for name, value in pairs)
    assert header_block(t, rp, rc, tp, tc, need, frac) == written
    assert admitted_pairs(t, rp, rc, tp, tc, need, frac) == pairs
    assert len(pairs) == 3 * (bool(rpm) + bool(tpm))


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


@pytest.fixture
async def behind_cut(cluster: str) -> AsyncIterator[tuple[Cut, Limiter, Limiter]]:
    """Two replicas on one clock: A reaches Redis through a relay the test can cut (and
    start again on its port), B directly."""
    if not REDIS_URL.startswith("redis://127.0.0.1:6379"):
        pytest.skip("the relay goes to 127.0.0.1:6379")
    relay = Cut()
    await relay.start()
    clock = Clock()
    a = shared_limiter(cluster, clock, url=f"redis://127.0.0.1:{relay.port}/0")
    b = shared_limiter(cluster, clock)
    try:
        yield relay, a, b
    finally:
        await a._redis.aclose()  # type: ignore[union-attr]
        await b._redis.aclose()  # type: ignore[union-attr]
        with contextlib.suppress(Exception):
            await relay.cut()


async def test_redis_lost_mid_run_then_back(
    behind_cut: tuple[Cut, Limiter, Limiter], caplog: pytest.LogCaptureFixture
) -> None:
    relay, a, b = behind_cut
    t = tenant(requests_per_minute=8)
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


async def test_a_slot_freed_while_redis_was_away_is_freed_there_when_it_is_back(
    behind_cut: tuple[Cut, Limiter, Limiter],
) -> None:
    relay, a, b = behind_cut
    t = tenant(max_concurrent=1)
    held = await a.admit(t, 0)
    assert held.shared
    await relay.cut()
    await a.refresh()  # finds Redis gone
    held.settle(0)  # the request ends while A cannot tell Redis
    await refused(b, t)  # Redis still counts A's request in flight
    await relay.start(relay.port)
    await a.refresh()  # back: the settlement goes out
    await b.admit(t, 0)


async def test_without_redis_each_of_n_replicas_enforces_its_share() -> None:
    limiter = Limiter(clock=Clock(), replicas=4)
    t = tenant(requests_per_minute=8)
    for _ in range(2):
        await limiter.admit(t, 0)
    over = await refused(limiter, t)
    assert "this replica's share: 2" in over.message


async def test_many_requests_at_once_share_few_round_trips(cluster: str) -> None:
    """300 requests admitted at once and settled: Redis counts every one (no replica
    falls back to its own counts for want of connections), in a few batched calls."""
    clock = Clock()
    a = shared_limiter(cluster, clock)
    t = tenant(requests_per_minute=10_000, tokens_per_minute=10**9, max_concurrent=10_000)
    sent = counting_calls(a)
    try:
        held = await asyncio.gather(*(a.admit(t, 10) for _ in range(300)))
        assert all(r.shared for r in held) and a.shared
        for r in held:
            r.settle(5)
        await a.close()
        assert len(sent) <= 4, len(sent)
        counts = await a._redis.mget(  # type: ignore[union-attr]
            a._key("acme", f"rpm:{int(T0 // 60)}"), a._key("acme", f"tpm:{int(T0 // 60)}")
        )
        assert counts == ["300", "1500"]
        assert await a._redis.zcard(a._key("acme", "concurrent")) == 0  # type: ignore[union-attr]
    finally:
        await a._redis.aclose()  # type: ignore[union-attr]


async def test_each_answer_says_how_many_replicas_are_there(cluster: str) -> None:
    """A replica learns of one that started after it from its next admission, not only
    from its next presence renewal: with Redis then lost it enforces the right share."""
    clock = Clock()
    a, b = shared_limiter(cluster, clock), shared_limiter(cluster, clock)
    t = tenant(requests_per_minute=100)
    try:
        await a.refresh()
        assert a.replicas == 1
        await b.refresh()  # b starts after a's presence renewal
        await a.admit(t, 0)
        assert a.replicas == 2
    finally:
        await a._redis.aclose()  # type: ignore[union-attr]
        await b._redis.aclose()  # type: ignore[union-attr]


async def test_an_admission_cancelled_on_its_way_gives_its_slot_back(cluster: str) -> None:
    clock = Clock()
    a, b = shared_limiter(cluster, clock), shared_limiter(cluster, clock)
    t = tenant(max_concurrent=1, tokens_per_minute=100)
    try:
        task = asyncio.create_task(a.admit(t, 60))
        await asyncio.sleep(0)  # queued for Redis
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await a._flushed()  # Redis admitted it; the limiter gives it back
        r = await b.admit(t, 60)  # the slot and the tokens are free
        assert r.headers["x-ratelimit-remaining-tokens"] == "40"
    finally:
        await a._redis.aclose()  # type: ignore[union-attr]
        await b._redis.aclose()  # type: ignore[union-attr]


async def broken_call(keys: list[str], args: list[str]) -> object:
    raise ValueError("a reply of an unexpected shape")


async def short_answer(keys: list[str], args: list[str]) -> object:
    return ["1", "1,0"]  # an admission's answer cut short


@pytest.mark.parametrize(
    ("script_call", "limit", "logged"),
    [
        (broken_call, 10, "the batch to Redis failed"),
        (short_answer, 1600, "an answer from Redis of an unexpected shape"),  # allotments
    ],
)
async def test_a_batch_that_goes_wrong_leaves_no_admission_waiting(
    cluster: str, caplog: pytest.LogCaptureFixture, script_call: object, limit: int, logged: str
) -> None:
    """Whatever goes wrong in a batch, its admissions are answered (from the replica's
    own counts, as with Redis down), never left waiting."""
    a = shared_limiter(cluster, Clock(), script_call=script_call)
    t = tenant(requests_per_minute=limit)
    try:
        async with asyncio.timeout(5):
            r = await a.admit(t, 0)
        assert not r.shared and not a.shared
        assert logged in caplog.text
    finally:
        await a._redis.aclose()  # type: ignore[union-attr]


# -- allotments ----------------------------------------------------------------------


class Calls:
    """The limiter's script calls to Redis (its round trips) since it was made: len()."""

    def __init__(self, limiter: Limiter):
        self.limiter = limiter
        self.before = limiter.calls

    def __len__(self) -> int:
        return self.limiter.calls - self.before


def counting_calls(limiter: Limiter) -> Calls:
    return Calls(limiter)


async def redis_counts(limiter: Limiter, minute: int = int(T0 // 60)) -> list[int]:
    """rpm and tpm of ``minute`` and requests in flight, as Redis has them."""
    r = limiter._redis
    assert r is not None
    found = await r.mget(
        limiter._key("acme", f"rpm:{minute}"), limiter._key("acme", f"tpm:{minute}")
    )
    return [int(v or 0) for v in found] + [await r.zcard(limiter._key("acme", "concurrent"))]


async def test_admissions_use_the_allotment_without_a_redis_call(cluster: str) -> None:
    clock = Clock()
    a = shared_limiter(cluster, clock)
    # blocks of 1/16 of each limit (one replica): 1000 requests, 625000 tokens a minute,
    # 6250000 a day, 8 slots at a time (of a most of 100 kept)
    t = tenant(requests_per_minute=16_000, tokens_per_minute=10**7, tokens_per_day=10**8,
               max_concurrent=1600)  # fmt: skip
    sent = counting_calls(a)
    try:
        first = await a.admit(t, 100)  # no allotment yet: checked in Redis, which grants
        assert first.shared and len(sent) == 1
        assert a.allotment("acme") == (1000, 625_000, 6_250_000, 8)
        # Redis counts the allotment at once: no other replica can take it
        assert await redis_counts(a) == [1 + 1000, 100 + 625_000, 9]
        first.settle(60)
        for _ in range(20):
            clock.now += 1
            r = await a.admit(t, 100)
            assert r.shared and r.headers["x-ratelimit-limit-requests"] == "16000"
            r.settle(60)
        assert len(sent) == 1  # every one of them from the allotment
        assert a.allotment("acme")[:2] == (980, 625_000 - 20 * 60)  # settled into it
        assert r.headers["x-ratelimit-remaining-requests"] == str(16_000 - 21)
        assert r.headers["x-ratelimit-remaining-tokens"] == str(10**7 - 20 * 60 - 100)
        await a.close()  # the allotment goes back: Redis has what was used, exactly
        assert await redis_counts(a) == [21, 21 * 60, 0]
    finally:
        await a._redis.aclose()  # type: ignore[union-attr]


async def test_an_allotment_running_low_is_topped_up_in_the_background(cluster: str) -> None:
    clock = Clock()
    a = shared_limiter(cluster, clock)
    t = tenant(requests_per_minute=160)  # blocks of 10 requests
    sent = counting_calls(a)
    try:
        for _ in range(40):
            (await a.admit(t, 0)).settle(0)
            await a._flushed()  # an ask for more is answered before the next request
        # one admission waited for Redis; the rest came from allotments asked for
        # ahead, at half a block left: one round trip every 6 requests
        assert len(sent) <= 1 + 40 // 6, len(sent)
        left = a.allotment("acme")[0]
        assert 0 < left <= 10
        assert (await redis_counts(a))[0] == 40 + left
    finally:
        await a._redis.aclose()  # type: ignore[union-attr]


async def test_the_gate_decides_here_what_the_allotment_covers(
    cluster: str, tmp_path: Path
) -> None:
    """``TenantGate.try_admit_http`` admits with no await once the replica holds an
    allotment, answers a Pending while Redis has to say (whose wait reads nothing
    again), and refuses an unknown priority class before anything is counted."""
    tenants = tmp_path / "tenants.toml"
    tenants.write_text('[[tenant]]\nname = "acme"\nkeys = ["sk-a"]\nrequests_per_minute = 160\n')
    source = TenantSource(tenants)
    await source.load()
    clock = Clock()
    a = shared_limiter(cluster, clock)
    gate = TenantGate(source, a, TenantMetrics(CollectorRegistry()), 16, clock=clock)
    body = json.dumps({"model": "m", "prompt": "hi", "max_tokens": 5}).encode()
    sent = counting_calls(a)
    try:
        pending = gate.try_admit_http(body, "Bearer sk-a", None)  # no allotment yet
        assert isinstance(pending, Pending) and len(sent) == 0
        first = await pending.admitted()  # Redis checks, grants
        assert len(sent) == 1 and a.allotment("acme")[0] == 10
        assert first.take_request() == json.loads(body)  # what the plain call parsed
        with pytest.raises(InvalidRequest):
            gate.try_admit_http(body, "Bearer sk-a", "urgent")
        assert a.allotment("acme")[0] == 10  # nothing counted for it
        admitted = gate.try_admit_http(body, "Bearer sk-a", "batch")
        assert isinstance(admitted, Admission) and len(sent) == 1
        assert (admitted.priority, admitted.cost) == ("batch", admitted.estimated + 5)
        assert admitted.take_request() == json.loads(body)
        assert "x-ratelimit-remaining-requests: 158\r\n" in admitted.header_block()
        assert a.allotment("acme")[0] == 9
        for admission in (first, admitted):
            admission.finish("200")
    finally:
        await a._redis.aclose()  # type: ignore[union-attr]


async def test_two_replicas_never_admit_over_a_limit_together(cluster: str) -> None:
    """Near the limit the blocks shrink to none and every request is checked in Redis:
    two replicas together admit the limit exactly, never one more."""
    clock = Clock()
    a, b = shared_limiter(cluster, clock), shared_limiter(cluster, clock)
    t = tenant(requests_per_minute=320, tokens_per_minute=320_000)
    try:
        for x in (a, b, a):
            await x.refresh()
        assert (a.replicas, b.replicas) == (2, 2)
        # at once, from both: what Redis grants is counted, so never over the limit
        results = await asyncio.gather(
            *(x.admit(t, 100) for _ in range(200) for x in (a, b)), return_exceptions=True
        )
        admitted = sum(1 for x in results if not isinstance(x, BaseException))
        assert all(isinstance(x, RateLimited) for x in results if isinstance(x, BaseException))
        assert admitted <= 320
        held = a.allotment("acme")[0] + b.allotment("acme")[0]
        assert admitted + held == (await redis_counts(a))[0] <= 320
        # one at a time: the allotments are spent, then each request goes to Redis
        sent_a, sent_b = counting_calls(a), counting_calls(b)
        for i in range(200):
            with contextlib.suppress(RateLimited):
                await (a, b)[i % 2].admit(t, 100)
                admitted += 1
        assert admitted == 320  # the limit, exactly: nothing left held unused
        assert a.allotment("acme")[:2] == b.allotment("acme")[:2] == (0, 0)
        assert len(sent_a) + len(sent_b) >= 200 - (320 - 10)  # refusals asked Redis
        assert (await redis_counts(a))[:2] == [320, 320 * 100]
    finally:
        await a._redis.aclose()  # type: ignore[union-attr]
        await b._redis.aclose()  # type: ignore[union-attr]


async def test_unused_allotment_goes_back_when_its_window_ends_and_when_idle(
    cluster: str,
) -> None:
    clock = Clock()
    a = shared_limiter(cluster, clock)
    t = tenant(requests_per_minute=1600, tokens_per_minute=1_600_000, max_concurrent=320)
    minute = int(T0 // 60)
    try:
        (await a.admit(t, 1000)).settle(1000)
        assert await redis_counts(a, minute) == [1 + 100, 1000 + 100_000, 9]
        clock.now = T0 + 61  # the next minute: what is left goes back to the one before
        held = await a.admit(t, 1000)
        await a._flushed()
        assert (await redis_counts(a, minute))[:2] == [1, 1000]
        assert (await redis_counts(a, minute + 1))[:2] == [1 + 100, 1000 + 100_000]
        a.sweep()  # not idle yet: nothing goes back
        await a._flushed()
        assert (await redis_counts(a, minute + 1))[:2] == [101, 101_000]
        clock.now += IDLE_S
        a.sweep()  # idle: all of it back, the free slots too; the one in use stays
        await a._flushed()
        assert await redis_counts(a, minute + 1) == [1, 1000, 1]
        assert a.allotment("acme") == (0, 0, 0, 0)
        held.settle(500)
        await a._flushed()
        assert await redis_counts(a, minute + 1) == [1, 500, 0]
        # a tenant's day limit goes back to its day the same way
        d = tenant(tokens_per_day=1_600_000)
        d.name = "acme"
        (await a.admit(d, 10)).settle(10)
        day_key = a._key("acme", f"tpd:{int(clock.now // 86_400)}")
        # (acme's two requests before counted 1000 each there too, untouched after)
        assert await a._redis.get(day_key) == str(2000 + 10 + 100_000)  # type: ignore[union-attr]
        clock.now += 86_400
        a.sweep()
        await a._flushed()
        assert await a._redis.get(day_key) == str(2000 + 10)  # type: ignore[union-attr]
    finally:
        await a._redis.aclose()  # type: ignore[union-attr]


async def test_concurrency_slots_held_by_a_replica(cluster: str) -> None:
    clock = Clock()
    a, b = shared_limiter(cluster, clock), shared_limiter(cluster, clock)
    t = tenant(max_concurrent=64)  # one replica seen: blocks of 4 slots
    sent = counting_calls(a)
    try:
        first = await a.admit(t, 0)
        assert a.allotment("acme")[3] == 4 and (await redis_counts(a))[2] == 5
        second = await a.admit(t, 0)  # a slot of its own: no round trip
        assert len(sent) == 1 and (await redis_counts(a))[2] == 5
        first.settle(0)
        second.settle(0)  # back to the replica's free slots, up to a block of them
        await a._flushed()
        assert a.allotment("acme")[3] == 4 and (await redis_counts(a))[2] == 4
        # together the two replicas never hold more than the limit in flight
        held = []
        for i in range(100):
            with contextlib.suppress(RateLimited):
                held.append(await (a, b)[i % 2].admit(t, 0))
        assert len(held) <= 64
        assert (await redis_counts(a))[2] <= 64
        assert len(held) >= 64 - 4  # at most a's few free slots unused
        for r in held:
            r.settle(0)
        # a replica that dies leaves its slots until their leases end
        await b.close()
        assert (await redis_counts(a))[2] > 0
        clock.now += LEASE_S + 1
        assert (await redis_counts(a))[2] > 0
        rest = [await b.admit(t, 0) for _ in range(64)]
        assert len(rest) == 64
    finally:
        await a._redis.aclose()  # type: ignore[union-attr]
        await b._redis.aclose()  # type: ignore[union-attr]


async def test_an_allotment_is_not_spent_while_redis_is_away_and_goes_back_after(
    behind_cut: tuple[Cut, Limiter, Limiter], caplog: pytest.LogCaptureFixture
) -> None:
    relay, a, b = behind_cut
    t = tenant(requests_per_minute=640)
    for x in (a, b, a):
        await x.refresh()
    first = await a.admit(t, 0)
    assert first.shared and a.allotment("acme")[0] == 20  # 640 / (2 replicas x 16)
    await relay.cut()
    await a.refresh()  # finds Redis gone
    assert not a.shared and a.allotment("acme") == (0, 0, 0, 0)
    admitted = 1
    with pytest.raises(RateLimited) as over:
        for _ in range(400):
            assert not (await a.admit(t, 0)).shared
            admitted += 1
    assert admitted == 320 and "this replica's share: 320" in over.value.message
    # Redis still counts what A held: B cannot take it while A is away
    assert (await redis_counts(b))[0] == 21
    await relay.start(relay.port)
    await a.refresh()  # back: the allotment goes back to Redis
    assert a.shared
    assert (await redis_counts(b))[0] == 1
    (await a.admit(t, 0)).settle(0)  # shared again, with a new allotment
    assert a.allotment("acme")[0] > 0


@given(
    st.floats(min_value=-1e10, max_value=1e10, allow_nan=False)
    | st.integers(min_value=-(10**8), max_value=10**8).map(lambda m: m * 60.0)
    | st.integers(min_value=-(10**8), max_value=10**8).map(
        lambda m: math.nextafter(m * 60.0, -math.inf)
    )
    | st.integers(min_value=-(10**8), max_value=10**8).map(
        lambda m: math.nextafter(m * 60.0, math.inf)
    )
)
def test_the_minute_of_a_time_is_its_floor_division(now: float) -> None:
    assert minute_of(now) == int(now // 60.0)
