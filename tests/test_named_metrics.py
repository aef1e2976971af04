"""Named metrics in load reports: a signal the sidecar sets reaches every gateway, by
every load source, with no field of its own anywhere (proto, JSON, Redis alike).

Real sidecars and gateways on loopback, a real Redis for the redis source, real gRPC
and HTTP report streams. Plus the report's own conversions: every field survives each
wire (a field left out of one conversion fails here, not in production)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import aiohttp
import pytest

from engine.base import ENGINE_SLOTS, EngineStats
from proxy.gateway.server import Gateway
from proxy.load import (
    MAX_METRIC_NAME,
    MAX_NAMED_METRICS,
    OUTSTANDING_BATCH,
    OUTSTANDING_STANDARD,
    PRIORITY_HEADROOM,
    LoadReport,
    NodeStatus,
    PrefixBlocks,
    UnitState,
    joined_metrics,
)
from proxy.settings import load
from tests.conftest import SidecarFactory, wait_until
from tests.redisenv import REDIS_URL, redis_section

pytestmark = pytest.mark.timeout(30)

SOURCES = ["watch", "watch-http", "poll", "redis"]


@pytest.mark.parametrize("source", SOURCES)
async def test_a_named_metric_set_by_the_sidecar_reaches_the_gateway(
    start_sidecar: SidecarFactory, http: aiohttp.ClientSession, cluster: str, source: str
) -> None:
    redis = redis_section(REDIS_URL, cluster)
    sidecar = await start_sidecar(sidecar={"unit_id": "a", "report_interval_s": 0.2}, redis=redis)
    gateway: dict[str, Any] = {"load_source": source, "poll_interval_s": 0.1}
    if source == "redis":
        gateway["discover_allow"] = ["http://127.0.0.1:*"]
    else:
        gateway["units"] = [f"a={sidecar.http_url},{sidecar.grpc_target}"]
    settings = load(
        {
            "server": {"host": "127.0.0.1", "http_port": 0, "grpc_port": 0},
            "gateway": gateway,
            "redis": redis,
        }
    )
    async with Gateway(settings) as gw:
        await wait_until(lambda: "a" in gw.router.units and gw.router.units["a"].report is not None,
                         what="the unit's first report")  # fmt: skip
        unit = gw.router.units["a"]
        assert unit.metric("queue_wait_s") == -1.0, "not set yet"
        sidecar.core.set_metric("queue_wait_s", 0.25)
        await wait_until(
            lambda: unit.metric("queue_wait_s") == 0.25, what=f"the metric by {source}"
        )
        sidecar.core.set_metric("queue_wait_s", 1.5)
        await wait_until(lambda: unit.metric("queue_wait_s") == 1.5, what="its change")
        async with http.get(f"{gw.http_url}/units") as resp:
            (shown,) = (await resp.json())["units"]
        # beside it, the engine's slots every sidecar reports (the simulator's 32), the
        # simulator's prefill queue (policy prefix bounds affinity by it), and the
        # allowance over capacity for a higher class with what it may go over (a quarter of
        # the capacity; nothing outstanding)
        assert shown["named_metrics"] == {
            "queue_wait_s": 1.5,
            ENGINE_SLOTS: 32.0,
            "prefill_queue_tokens": 0.0,
            PRIORITY_HEADROOM: 8.0,
            OUTSTANDING_BATCH: 0.0,
            OUTSTANDING_STANDARD: 0.0,
        }


def test_the_engines_named_metrics_join_the_sidecars() -> None:
    engine = {"engine_only": 2.0, "both": 3.0}
    assert joined_metrics(engine, {"both": 4.0}) == {"engine_only": 2.0, "both": 4.0}
    assert joined_metrics({}, {"s": 1.0}) == {"s": 1.0}
    sidecar = {"s": 1.0}
    joined_metrics({}, sidecar)["s"] = 2.0
    assert sidecar == {"s": 1.0}, "a report's map is its own"


async def test_the_sidecar_refuses_a_metric_past_the_bounds(start_sidecar: SidecarFactory) -> None:
    core = (await start_sidecar()).core
    for bad in ("", "x" * (MAX_METRIC_NAME + 1)):
        with pytest.raises(ValueError):
            core.set_metric(bad, 1.0)
    with pytest.raises(ValueError):
        core.set_metric("nan", math.nan)
    for i in range(MAX_NAMED_METRICS):
        core.set_metric(f"m{i}", float(i))
    core.set_metric("m0", 9.0)  # a name already there may change
    with pytest.raises(ValueError):
        core.set_metric("one_too_many", 1.0)
    assert len(core.report().named_metrics) == MAX_NAMED_METRICS


def test_a_reader_keeps_the_bounds_whatever_a_peer_sends() -> None:
    sent = {f"m{i:02d}": float(i) for i in range(MAX_NAMED_METRICS + 8)}
    sent |= {"x" * (MAX_METRIC_NAME + 1): 1.0, "": 1.0, "inf": math.inf, "flag": True}
    data = {**LoadReport("a", UnitState.SERVING, 0, 1).to_dict(), "named_metrics": sent}
    got = LoadReport.from_dict(data).named_metrics
    assert list(got) == sorted(f"m{i:02d}" for i in range(MAX_NAMED_METRICS))
    pb = LoadReport("a", UnitState.SERVING, 0, 1).to_pb()
    pb.named_metrics.update({k: v for k, v in sent.items() if not isinstance(v, bool)})
    assert LoadReport.from_pb(pb).named_metrics == got
    with pytest.raises(TypeError):
        LoadReport.from_dict({**data, "named_metrics": [1, 2]})


def every_field_set() -> LoadReport:
    """A report whose every field differs from its default."""
    report = LoadReport(
        unit_id="u7", state=UnitState.DRAINING, outstanding=3, capacity=9, running=2,
        waiting=1, kv_cache_usage=0.5, seq=11, timestamp_ms=1234, http_url="http://h:1",
        grpc_target="h:2", prefix_cache_hit_rate=0.25, models=("m", "lora"),
        prefix_cache_queries=100, prefix_cache_hits=40, prefix_cache_resets=2,
        nodes=(NodeStatus("n0", "leader", "h:3", False, "down", 99),),
        named_metrics={"queue_wait_s": 0.125},
        prefix_blocks=PrefixBlocks(7, 3, 5, False, (1, 2**64 - 1), (4,), 256),
        watcher_outstanding=2,
    )  # fmt: skip
    blank = LoadReport("", UnitState.STARTING, 0, 0)
    for f in dataclasses.fields(LoadReport):
        assert getattr(report, f.name) != getattr(blank, f.name), f"set {f.name} here"
    return report


def test_every_field_survives_every_wire() -> None:
    import json

    report = every_field_set()
    assert LoadReport.from_pb(report.to_pb()) == report
    assert LoadReport.from_dict(json.loads(report.to_json())) == report
    assert LoadReport.from_dict(report.to_dict()) == report


def test_engine_stats_named_metrics_default_empty() -> None:
    assert EngineStats().named_metrics == {}
