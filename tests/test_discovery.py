"""Units discovered through Redis: only those gateway.discover_allow lets in, up to
gateway.max_units; a refusal is logged once per unit and counted by reason.

The rules on their own first, then a gateway reading a real Redis where anyone may
publish: reports that point elsewhere are refused, and routing is unchanged.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter
from redis.asyncio import Redis

from proxy.gateway.discovery import Discovery
from proxy.load import LoadReport, UnitState
from proxy.redis_reports import Keys
from proxy.settings import GatewaySettings, UnitTarget
from tests.conftest import SidecarFactory, wait_until
from tests.redisenv import REDIS_URL
from tests.test_redis import (  # noqa: F401 (fixtures)
    GatewayStarter,
    start_gateway_on_redis,
    start_unit,
)

pytestmark = pytest.mark.timeout(30)


def rules(**settings: Any) -> tuple[Discovery, Counter]:
    counter = Counter("refused", "", ["reason"], registry=CollectorRegistry())
    return Discovery(GatewaySettings(**settings), counter), counter


def target(spec: str) -> UnitTarget:
    return UnitTarget.parse(spec)


@pytest.mark.parametrize(
    ("spec", "reason"),
    [
        ("a=http://10.0.3.4:8080,10.0.3.4:50051", None),
        ("a=http://10.0.3.4:8080/,10.0.3.4:50051", None),
        ("a=http://10.0.3.4,10.0.3.4:50051", "not_allowed"),  # port 80
        ("a=http://10.1.3.4:8080,10.1.3.4:50051", "not_allowed"),  # another network
        ("a=http://10.0.3.4:9999,10.0.3.4:50051", "not_allowed"),  # another port
        ("a=http://10.0.3.4:8080,169.254.169.254:80", "not_allowed"),  # gRPC elsewhere
        ("a=http://10.0.3.4:8080@evil.example,evil.example:1", "not_allowed"),
        ("a=http://10.0.3.4:8080@evil.example:8080,evil.example:1", "not_allowed"),
        ("a=http://10.0.3.4:8080/x,10.0.3.4:50051", "not_allowed"),
        ("a b=http://10.0.3.4:8080,10.0.3.4:50051", "bad_id"),
        ("x" * 64 + "=http://10.0.3.4:8080,10.0.3.4:50051", "bad_id"),
    ],
)
def test_the_rules(spec: str, reason: str | None) -> None:
    discovery, _ = rules(discover_allow=["http://10.0.*:8080"])
    assert discovery.refusal(target(spec), known=0) == reason


def test_nothing_is_allowed_by_default_and_the_cap_holds() -> None:
    spec = "a=http://10.0.3.4:8080,10.0.3.4:50051"
    assert rules()[0].refusal(target(spec), known=0) == "not_allowed"
    capped, _ = rules(discover_allow=["http://10.0.*"], max_units=2)
    assert capped.refusal(target(spec), known=1) is None
    assert capped.refusal(target(spec), known=2) == "max_units"


def test_with_a_ca_file_only_https_units(tmp_path: Any) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_text("")
    discovery, _ = rules(discover_allow=["*://10.0.*"], tls_ca_file=ca)
    assert discovery.refusal(target("a=http://10.0.3.4:1,10.0.3.4:2"), known=0) == "tls"
    assert discovery.refusal(target("a=https://10.0.3.4:1,10.0.3.4:2"), known=0) is None


def test_a_refusal_is_counted_each_time_and_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    discovery, counter = rules(discover_allow=["http://10.0.*"])
    evil = target("evil=http://203.0.113.9:80,203.0.113.9:81")
    for _ in range(3):
        assert not discovery.admit(evil, known=0)
    assert counter.labels("not_allowed")._value.get() == 3
    assert caplog.text.count("'evil'") == 1


async def test_a_gateway_routes_only_to_allowed_units_from_redis(
    redis: Redis,
    cluster: str,
    start_sidecar: SidecarFactory,
    start_gateway_on_redis: GatewayStarter,  # noqa: F811
) -> None:
    await start_unit(start_sidecar, "a", REDIS_URL, cluster)
    gw = await start_gateway_on_redis(REDIS_URL, cluster, max_units=2)
    await wait_until(lambda: len(gw.router.serving()) == 1, what="gateway discovers a")
    channel = Keys(cluster).channel

    def report(unit_id: str, http_url: str, grpc_target: str) -> str:
        now_ms = int(time.time() * 1000)
        return LoadReport(unit_id, UnitState.SERVING, 0, 64, seq=1, timestamp_ms=now_ms,
                          http_url=http_url, grpc_target=grpc_target).to_json()  # fmt: skip

    # Someone who can publish points a unit elsewhere, then floods unit ids.
    await redis.publish(channel, report("evil", "http://203.0.113.9:80", "203.0.113.9:81"))
    for i in range(5):
        await redis.publish(channel, report(f"u{i}", "http://127.0.0.1:1", "127.0.0.1:2"))

    def refused(reason: str) -> float:
        value = gw.registry.get_sample_value(
            "unitproxy_discovery_refused_total", {"reason": reason}
        )
        return value or 0.0

    await wait_until(lambda: refused("max_units") == 4, what="refusals counted")
    assert refused("not_allowed") == 1
    assert set(gw.router.units) == {"a", "u0"}  # u0 fitted under max_units 2
