"""The router records what it observes in the gateway's one metrics object, handed to
it: no callback per observation wired through the server. On an injected clock."""

from __future__ import annotations

import random

import pytest
from prometheus_client import CollectorRegistry

from proxy.gateway.router import Router
from proxy.load import LoadReport, UnitState
from proxy.metrics import GatewayMetrics
from proxy.settings import GatewaySettings, UnitTarget

pytestmark = pytest.mark.timeout(10)


def target(uid: str) -> UnitTarget:
    return UnitTarget(id=uid, http_url=f"http://{uid}:1", grpc_target=f"{uid}:2")


def test_the_router_records_its_units_in_the_metrics_it_is_given() -> None:
    registry = CollectorRegistry()
    now = [100.0]
    r = Router(GatewaySettings(stale_after_s=5.0), [target("a")], rng=random.Random(1),
               clock=lambda: now[0], metrics=GatewayMetrics(registry))  # fmt: skip

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, labels)

    assert value("unitproxy_routed_requests_total", unit="a") == 0, "a series from the start"
    assert value("unitproxy_gateway_unit_state", unit="a", state="UNKNOWN") == 1
    r.apply_report("a", LoadReport("a", UnitState.SERVING, 3, 10, seq=1))
    assert value("unitproxy_gateway_unit_state", unit="a", state="SERVING") == 1
    assert value("unitproxy_unit_load", unit="a") == 3, "its estimated outstanding"
    now[0] += 6.0
    assert value("unitproxy_gateway_unit_state", unit="a", state="LOST") == 1
    assert value("unitproxy_unit_load", unit="a") is None, "a lost unit is not idle"
    r.add(target("b"))  # discovered later
    assert value("unitproxy_routed_requests_total", unit="b") == 0
    assert value("unitproxy_queue_waiting_requests") == 0


def test_policy_prefix_records_its_index_corrections() -> None:
    registry = CollectorRegistry()
    r = Router(GatewaySettings(policy="prefix"), [target("a")], metrics=GatewayMetrics(registry))
    counted = {"prefix_cache_queries": 8, "prefix_cache_hits": 4}  # an engine that counts
    r.apply_report("a", LoadReport("a", UnitState.SERVING, 0, 10, seq=1, **counted))
    r.apply_report("a", LoadReport("a", UnitState.SERVING, 0, 10, seq=2, prefix_cache_resets=1,
                                   **counted))  # fmt: skip
    forgotten = {"action": "forgotten"}
    assert registry.get_sample_value("unitproxy_prefix_index_corrections_total", forgotten) == 1
