"""Fewer load reports on a watcher's request, and how a gateway sizes its request."""

from __future__ import annotations

import asyncio
import random

import aiohttp
import grpc
import pytest

from proxy.broadcast import Broadcast
from proxy.gateway.rates import ReportRates, report_rates, scaled
from proxy.gateway.server import Gateway
from proxy.load import LoadReport, UnitState
from proxy.pb.unitproxy.v1 import inference_pb2, inference_pb2_grpc, load_pb2, load_pb2_grpc
from proxy.settings import GatewaySettings, Settings, UnitTarget
from proxy.sidecar.watch import ReportWatch
from tests.conftest import SidecarFactory

pytestmark = pytest.mark.timeout(20)


def gateway(units: int, **settings: object) -> GatewaySettings:
    targets = [UnitTarget(id=f"u{i}", http_url=f"http://u{i}:1", grpc_target=f"u{i}:2")
               for i in range(units)]  # fmt: skip
    return GatewaySettings(units=targets, max_units=max(256, len(targets)), **settings)


def test_a_small_fleet_reports_changes_at_most_every_min_interval() -> None:
    # The budget alone would allow 4 ms (1 unit) or 32 ms (8 units): the floor holds.
    assert report_rates(gateway(1), 1) == ReportRates(min_interval_s=0.05)
    assert report_rates(gateway(8), 8).min_interval_ms == 50
    g = scaled(gateway(1))  # no longer heartbeat: staleness and polling as configured
    assert g.stale_after_s == 5 and g.poll_interval_s == 1
    floor = {"report_min_interval_s": 0.2}
    assert report_rates(gateway(8, report_budget_per_s=0, **floor), 8_000).min_interval_ms == 200
    assert report_rates(gateway(100, **floor), 100).min_interval_ms == 400  # the budget's


def test_without_the_floor_a_small_fleet_reports_at_the_units_own_rate() -> None:
    free = {"report_min_interval_s": 0}
    assert report_rates(gateway(1, **free), 1) == ReportRates()  # 4 ms: the unit's 5 ms holds
    assert scaled(gateway(1, **free)) == gateway(1, **free)
    assert report_rates(gateway(8, report_budget_per_s=0, **free), 8_000) == ReportRates()
    assert report_rates(gateway(8, **free), 8).min_interval_ms == 32


def test_a_large_fleet_is_asked_for_fewer_reports_and_ages_them_slower() -> None:
    rates = report_rates(gateway(8), 8)
    assert rates.min_interval_ms == 50 and rates.heartbeat_ms == 0
    assert scaled(gateway(8)).stale_after_s == 5
    rates = report_rates(gateway(250), 250)
    assert rates.min_interval_ms == 1000 and rates.heartbeat_ms == 0
    g = scaled(gateway(250))
    assert g.stale_after_s == 5 and g.poll_interval_s == 1
    rates = report_rates(gateway(1000), 1000)
    assert rates.min_interval_ms == 4000 and rates.heartbeat_ms == 4000
    g = scaled(gateway(1000))
    assert g.stale_after_s == 12 and g.poll_interval_s == 4
    assert scaled(gateway(5000, report_budget_per_s=1000)).stale_after_s == 15


async def test_changes_come_no_more_often_than_the_watcher_asked(
    start_sidecar: SidecarFactory,
) -> None:
    sidecar = await start_sidecar(sidecar={"report_interval_s": 30.0})
    async with grpc.aio.insecure_channel(sidecar.grpc_target) as channel:
        load = load_pb2_grpc.LoadReportingStub(channel)
        asked = load_pb2.WatchLoadRequest(min_interval_ms=400)
        watch = load.WatchLoad(asked, timeout=15)
        loop = asyncio.get_running_loop()
        initial = await asyncio.wait_for(watch.read(), 5)
        sent_at = loop.time()
        stub = inference_pb2_grpc.InferenceStub(channel)
        request = inference_pb2.GenerateRequest(
            request_id="r-1", prompt="hi", sampling=inference_pb2.SamplingParams(max_tokens=100_000)
        )
        held = stub.Generate(request, timeout=10)
        await held.read()  # admitted at once; its report waits for the interval
        admitted = await asyncio.wait_for(watch.read(), 5)
        assert admitted.outstanding == 1 and admitted.seq > initial.seq
        # The first interval is a random part of the asked one (streams out of step).
        assert loop.time() - sent_at <= 0.45
        sent_at = loop.time()
        held.cancel()
        released = await asyncio.wait_for(watch.read(), 5)
        assert released.outstanding == 0
        assert loop.time() - sent_at >= 0.35
        watch.cancel()


class _Health:
    def __init__(self) -> None:
        self.state_changes = Broadcast()


class Idle:
    """A unit whose load never moves: it reports heartbeats only."""

    def __init__(self) -> None:
        self.health = _Health()

    def report(
        self, blocks_since: tuple[int, int] | None = None, watcher: str | None = None
    ) -> LoadReport:
        return LoadReport("u", UnitState.SERVING, 0, 8)


async def test_streams_opened_together_do_not_report_in_step() -> None:
    watch = ReportWatch(Idle(), Broadcast(), interval_s=30.0, rng=random.Random(5))
    loop = asyncio.get_running_loop()
    second_at: list[float] = []

    async def follow() -> None:
        reports = watch.reports(heartbeat_ms / 1000, heartbeat_ms / 1000)
        await anext(reports)
        await anext(reports)
        second_at.append(loop.time())

    heartbeat_ms = 600
    started = loop.time()
    async with asyncio.timeout(5):
        await asyncio.gather(*(follow() for _ in range(20)))
    offsets = sorted(t - started for t in second_at)
    assert offsets[-1] <= 0.7  # within one asked heartbeat
    assert offsets[-1] - offsets[0] >= 0.3  # spread over it, not in step


async def test_a_watcher_may_ask_for_a_longer_heartbeat(start_sidecar: SidecarFactory) -> None:
    sidecar = await start_sidecar(sidecar={"report_interval_s": 0.1})
    async with grpc.aio.insecure_channel(sidecar.grpc_target) as channel:
        load = load_pb2_grpc.LoadReportingStub(channel)
        watch = load.WatchLoad(load_pb2.WatchLoadRequest(heartbeat_ms=1000), timeout=10)
        await asyncio.wait_for(watch.read(), 5)
        first = await asyncio.wait_for(watch.read(), 2)  # after a random part of 1 s
        next_read = asyncio.ensure_future(watch.read())
        done, _ = await asyncio.wait({next_read}, timeout=0.5)
        assert not done  # the unit's own 0.1 s heartbeat would have sent 5 by now
        second = await asyncio.wait_for(next_read, 2)
        assert second.seq > first.seq
        watch.cancel()


async def test_load_watch_over_http_takes_the_same_request(start_sidecar: SidecarFactory) -> None:
    sidecar = await start_sidecar(sidecar={"report_interval_s": 0.1})
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{sidecar.http_url}/load/watch?heartbeat_ms=x") as resp:
            assert resp.status == 400
        # "²" passes str.isdigit() but not int(): a 400 that says why, not a 500.
        async with session.get(f"{sidecar.http_url}/load/watch?min_interval_ms=\u00b2") as resp:
            assert resp.status == 400
            assert "min_interval_ms must be a whole number" in await resp.text()
        async with session.get(f"{sidecar.http_url}/load/watch?heartbeat_ms=1000") as resp:
            assert resp.status == 200
            first = await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 5)
            assert first.startswith(b"data: {")
            await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 2)  # a random part of 1 s
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 0.5)


def test_what_the_gateway_shows_ages_reports_by_the_bound_it_routes_by() -> None:
    # 1,000 units: the router trusts a report for 12 s, not the configured 5. /units,
    # /ready and unitproxy_gateway_unit_state say LOST exactly when routing stops.
    now = [100.0]
    gw = Gateway(Settings(gateway=gateway(1000)), clock=lambda: now[0])
    assert gw.router.settings.stale_after_s == 12
    gw.router.apply_report("u0", LoadReport("u0", UnitState.SERVING, 0, 4, seq=1))
    unit = gw.router.units["u0"]

    def shown() -> tuple[str, str, str]:
        state = gw._unit_json(unit, now[0])["state"]
        ready = "SERVING" if gw._ready_body()["units"].get("SERVING") else "-"
        scraped = {
            uid: state for uid, state, _, _ in gw.router.unit_views()
        }  # the unit_state series
        return state, ready, scraped["u0"]

    now[0] += 8.0  # past the configured bound, within the stretched one
    assert [u.id for u in gw.router.candidates()] == ["u0"]
    assert shown() == ("SERVING", "SERVING", "SERVING")
    now[0] += 4.0  # at the stretched bound: routing stops, and so does what is shown
    assert gw.router.candidates() == []
    assert shown() == ("LOST", "-", "LOST")


def test_while_the_load_source_is_down_units_show_as_they_are_routed() -> None:
    # A Redis outage pauses the router's aging: /units, /ready and unit_state must not
    # call a unit LOST (UnitproxyUnitLost firing for the whole fleet) that still takes
    # requests, and must show it LOST once it no longer does.
    now = [100.0]
    gw = Gateway(Settings(gateway=gateway(2, load_source="redis")), clock=lambda: now[0])
    for uid in ("u0", "u1"):
        gw.router.apply_report(uid, LoadReport(uid, UnitState.SERVING, 0, 4, seq=1))
    u0 = gw.router.units["u0"]

    def shown() -> tuple[str, float, int, str]:
        shown = gw._unit_json(u0, now[0])
        scraped = {
            uid: state for uid, state, _, _ in gw.router.unit_views()
        }  # the unit_state series
        serving = gw._ready_body()["units"].get("SERVING", 0)
        return shown["state"], shown["report_age_s"], serving, scraped["u0"]

    now[0] += 2.0
    gw.router.pause_aging()  # Redis is down
    now[0] += 60.0
    assert {u.id for u in gw.router.candidates()} == {"u0", "u1"}
    assert shown() == ("SERVING", 2.0, 2, "SERVING")
    gw.router.resume_aging()  # back: reports age again from 2 s old
    gw.router.apply_report("u1", LoadReport("u1", UnitState.SERVING, 0, 4, seq=2))
    now[0] += 3.0
    assert [u.id for u in gw.router.candidates()] == ["u1"]  # u0 is 5 s old: routing stops
    assert shown() == ("LOST", 5.0, 1, "LOST")
