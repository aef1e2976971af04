"""What the gateway logs about a unit it cannot get a load report from: a WARNING only
for what is wrong. ``unitproxy up`` starts the gateway before the sidecars listen, so a
unit refusing connections at first is no news; on an injected clock, no sleeps."""

from __future__ import annotations

import logging
import random

import pytest

from proxy.gateway.router import Router
from proxy.load import LoadReport, UnitState
from proxy.settings import GatewaySettings, UnitTarget

pytestmark = pytest.mark.timeout(10)
REFUSED = "load stream broke: UNAVAILABLE: connection refused"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def levels(caplog: pytest.LogCaptureFixture) -> list[str]:
    found = [r.levelname for r in caplog.records if "no load report" in r.getMessage()]
    caplog.clear()
    return found


def test_a_unit_not_listening_yet_is_info_until_the_grace_passes(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="proxy.gateway.router")
    clock = Clock()
    target = UnitTarget(id="a", http_url="http://a:1", grpc_target="a:2")
    r = Router(GatewaySettings(stale_after_s=5.0), [target], rng=random.Random(1), clock=clock)
    unit = r.units["a"]
    r.forget_report("a", REFUSED)
    r.forget_report("a", REFUSED)  # the load source's next try: the same reason, no new line
    assert levels(caplog) == ["INFO"]
    clock.now += 5.0  # stale_after_s since the gateway started, and still nothing
    r.forget_report("a", REFUSED)
    assert levels(caplog) == ["WARNING"]
    r.forget_report("a", REFUSED)
    assert levels(caplog) == []
    assert unit.view(clock.now, 5.0) == ("UNKNOWN", "connection refused")


def test_a_unit_lost_after_it_reported_is_a_warning_at_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="proxy.gateway.router")
    clock = Clock()
    target = UnitTarget(id="a", http_url="http://a:1", grpc_target="a:2")
    r = Router(GatewaySettings(stale_after_s=5.0), [target], rng=random.Random(1), clock=clock)
    r.apply_report("a", LoadReport("a", UnitState.SERVING, 0, 4, seq=1))
    r.forget_report("a", REFUSED)
    assert levels(caplog) == ["WARNING"]
