"""Passive ejection is capped at gateway.max_ejection_percent of the SERVING units.

The router on its own, on an injected clock: every unit fails fast; only the allowed
share is ejected, the rest keep taking requests, and an ejected unit's return lets
another one out.
"""

from __future__ import annotations

import logging

import pytest

from proxy.gateway.router import Outcome, Router
from proxy.load import LoadReport, UnitState
from proxy.settings import GatewaySettings, UnitTarget

pytestmark = pytest.mark.timeout(10)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def router(units: int, percent: int | None = None) -> tuple[Router, Clock]:
    extra = {} if percent is None else {"max_ejection_percent": percent}
    settings = GatewaySettings(eject_after=2, eject_s=10.0, **extra)
    clock = Clock()
    targets = [UnitTarget(id=f"u{i}", http_url=f"http://u{i}:1", grpc_target=f"u{i}:2")
               for i in range(units)]  # fmt: skip
    r = Router(settings, targets, clock=clock)
    for t in targets:
        r.apply_report(t.id, LoadReport(t.id, UnitState.SERVING, 0, 8, seq=1))
    return r, clock


def fail_everywhere(r: Router, rounds: int = 3) -> None:
    for _ in range(rounds * r.settings.eject_after):
        for unit in list(r.units.values()):
            unit.inflight += 1
            r.release(unit, Outcome.FAILED)


def ejected(r: Router, clock: Clock) -> set[str]:
    return {u.id for u in r.units.values() if clock.now < u.ejected_until}


@pytest.mark.parametrize(
    ("units", "percent", "most"),
    [(4, None, 2), (5, None, 2), (2, None, 1), (1, None, 0), (4, 0, 0), (4, 100, 4), (10, 30, 3)],
)
def test_never_more_than_the_share(units: int, percent: int | None, most: int) -> None:
    r, clock = router(units, percent)
    fail_everywhere(r)
    assert len(ejected(r, clock)) == most
    assert len(r.candidates()) == units - most  # the rest still take requests


def test_a_unit_back_from_ejection_lets_another_out(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    r, clock = router(2)
    fail_everywhere(r)
    first = ejected(r, clock)
    assert len(first) == 1
    held_back = caplog.text.count("is not ejected")
    assert held_back == 1, "logged once, not at every failure"
    clock.now += 11.0  # the ejection ran out
    assert ejected(r, clock) == set()
    kept = next(u for u in r.units.values() if u.id not in first)
    for _ in range(r.settings.eject_after):
        kept.inflight += 1
        r.release(kept, Outcome.FAILED)
    assert ejected(r, clock) == {kept.id}


def test_units_not_serving_do_not_count() -> None:
    r, clock = router(4)
    for unit_id in ("u2", "u3"):
        r.apply_report(unit_id, LoadReport(unit_id, UnitState.NOT_SERVING, 0, 8, seq=2))
    fail_everywhere(r)
    # Two SERVING units: one may go; the units not serving get no request either way.
    assert len(ejected(r, clock) & {"u0", "u1"}) == 1
