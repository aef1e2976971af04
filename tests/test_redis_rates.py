"""Fewer load reports through Redis when a gateway in front of a large fleet asks."""

from __future__ import annotations

import asyncio
import random

import pytest
from redis.asyncio import Redis

from proxy.broadcast import Broadcast
from proxy.gateway.loadsource import RedisSource
from proxy.gateway.router import Router
from proxy.gateway.units import Unit
from proxy.load import LoadReport, UnitState
from proxy.redis_reports import Keys, asked_s
from proxy.settings import GatewaySettings, RedisSettings, UnitTarget
from proxy.sidecar.publisher import ReportPublisher
from tests.conftest import wait_until
from tests.redisenv import REDIS_URL

pytestmark = pytest.mark.timeout(30)


class Unit1:
    """What a publisher reports: one unit whose state a test sets."""

    def __init__(self) -> None:
        self.state = UnitState.SERVING
        self.seq = 0

    def report(
        self, blocks_since: tuple[int, int] | None = None, watcher: str | None = None
    ) -> LoadReport:
        self.seq += 1
        return LoadReport("u1", self.state, self.seq % 7, 8, seq=self.seq)


async def test_a_sidecar_reports_as_seldom_as_gateways_ask_but_a_state_change_at_once(
    redis: Redis, cluster: str
) -> None:
    await redis.set(Keys(cluster).asked, 300, px=30_000)
    unit, changes = Unit1(), Broadcast()
    settings = RedisSettings(url=REDIS_URL, cluster=cluster, timeout_s=1.0)
    async with ReportPublisher(settings, unit.report, changes, interval_s=30.0) as publisher:
        await wait_until(lambda: publisher.asked_s == 0.3, what="the asked interval read")
        first = publisher.published
        for _ in range(100):  # a change every 10 ms for 1 s: 100 reports unasked
            changes.notify()
            await asyncio.sleep(0.01)
        assert 2 <= publisher.published - first <= 6
        before = publisher.published
        await asyncio.sleep(0.05)  # in the middle of a hold
        unit.state = UnitState.NOT_SERVING
        changes.notify()
        await wait_until(lambda: publisher.published > before, 0.25, "the state change")


def test_an_asked_interval_that_is_not_ascii_digits_reads_as_none_asked() -> None:
    # "²" passes str.isdigit() but not int(): the publisher logged a traceback each time.
    assert [asked_s(v) for v in ("300", "\u00b2", "-5", "", None)] == [0.3, 0.0, 0.0, 0.0, 0.0]


@pytest.mark.parametrize(
    ("units", "asked", "stale_s"), [(2, "50", 5), (100, "400", 5), (1000, "4000", 12)]
)
async def test_a_redis_gateway_asks_by_fleet_size_and_stretches_its_staleness_bound(
    redis: Redis, cluster: str, units: int, asked: str, stale_s: float
) -> None:
    targets = [UnitTarget(id=f"u{i}", http_url=f"http://u{i}:1", grpc_target=f"u{i}:2")
               for i in range(units)]  # fmt: skip
    router = Router(GatewaySettings(load_source="redis"), targets, rng=random.Random(1))

    def discover(target: UnitTarget) -> Unit:
        return router.add(target)

    source = RedisSource(router, RedisSettings(url=REDIS_URL, cluster=cluster), discover)
    task = asyncio.create_task(source.run())
    try:
        key = Keys(cluster).asked
        async with asyncio.timeout(5):
            while await redis.get(key) is None:
                await asyncio.sleep(0.02)
        assert await redis.get(key) == asked  # N / 250 s, at least report_min_interval_s
        assert 0 < await redis.pttl(key) <= 30_000
        assert router.settings.stale_after_s == stale_s  # 3 heartbeats, at least 5 s
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
