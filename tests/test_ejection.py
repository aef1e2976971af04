"""Passive ejection that learns (Envoy's outlier detection): a unit ejected again right
after its cool-down stays out longer, eject_s times its ejections in a row up to
max_eject_s, and heals back once it answers. The router on its own, on an injected
clock; the last test plays 32 looping clients against a black-hole unit in virtual
time. The core's rule that a client who gave up on a silent unit counts as its
failure is tested with real servers in test_gateway.py.
"""

from __future__ import annotations

import heapq
import random

import pytest

from proxy.gateway.router import Outcome, Router
from proxy.gateway.units import Unit
from proxy.load import LoadReport, UnitState
from proxy.settings import GatewaySettings, UnitTarget

pytestmark = pytest.mark.timeout(20)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def fleet(units: int = 2, capacity: int = 8, **settings: object) -> tuple[Router, Clock]:
    clock = Clock()
    targets = [UnitTarget(id=f"u{i}", http_url=f"http://u{i}:1", grpc_target=f"u{i}:2")
               for i in range(units)]  # fmt: skip
    r = Router(GatewaySettings(**settings), targets, rng=random.Random(3), clock=clock)
    for t in targets:
        r.apply_report(t.id, LoadReport(t.id, UnitState.SERVING, 0, capacity, seq=1))
    return r, clock


def answer(r: Router, unit: Unit, outcome: Outcome, times: int = 1) -> None:
    for _ in range(times):
        unit.inflight += 1
        r.release(unit, outcome)


def reports(r: Router, capacity: int) -> None:
    """Every unit reports again, SERVING and idle by its own count."""
    for unit in r.units.values():
        seq = unit.report.seq + 1 if unit.report else 1
        r.apply_report(unit.id, LoadReport(unit.id, UnitState.SERVING, 0, capacity, seq=seq))


def ejected_for(unit: Unit, clock: Clock) -> float:
    return max(0.0, unit.ejected_until - clock.now)


def test_a_unit_that_fails_again_after_its_cool_down_is_ejected_for_longer() -> None:
    r, clock = fleet(eject_after=3, eject_s=5.0, max_eject_s=12.0)
    u0 = r.units["u0"]
    lasted = []
    for _ in range(4):
        answer(r, u0, Outcome.FAILED, 3)
        lasted.append(ejected_for(u0, clock))
        clock.now = u0.ejected_until  # back, and failing again at once
    assert lasted == [5.0, 10.0, 12.0, 12.0]  # base x ejections in a row, capped
    assert u0.ejections == 4


def test_failures_of_requests_sent_before_an_ejection_do_not_add_one() -> None:
    r, clock = fleet(eject_after=3, eject_s=5.0)
    u0 = r.units["u0"]
    answer(r, u0, Outcome.FAILED, 3)
    clock.now += 1.0
    answer(r, u0, Outcome.FAILED, 5)  # the rest of what it held times out
    assert u0.ejections == 1 and ejected_for(u0, clock) == 5.0  # extended, not longer


def test_a_unit_that_answers_after_its_ejections_heals_back_to_eject_s() -> None:
    r, clock = fleet(eject_after=3, eject_s=5.0, max_eject_s=300.0)
    u0 = r.units["u0"]
    for _ in range(3):
        answer(r, u0, Outcome.FAILED, 3)
        clock.now = u0.ejected_until
    assert u0.ejections == 3
    answer(r, u0, Outcome.OK)  # back, answering, but not for eject_s yet
    assert u0.ejections == 3
    clock.now += 5.0
    answer(r, u0, Outcome.OK)
    assert u0.ejections == 2
    clock.now += 2.5
    answer(r, u0, Outcome.OK)  # within the next eject_s: nothing more yet
    assert u0.ejections == 2
    clock.now += 60.0  # answering on and off for a minute
    answer(r, u0, Outcome.OK)
    assert u0.ejections == 0
    answer(r, u0, Outcome.FAILED, 3)
    assert ejected_for(u0, clock) == 5.0
    clock.now = u0.ejected_until + 1.0
    answer(r, u0, Outcome.CANCELLED, 4)  # clients who left early say nothing either way
    answer(r, u0, Outcome.REFUSED, 4)
    assert u0.ejections == 1


def test_back_from_an_ejection_a_unit_takes_one_request_until_one_is_answered() -> None:
    r, clock = fleet(capacity=4, eject_after=3, eject_s=5.0, policy="lor")
    u0, u1 = r.units["u0"], r.units["u1"]
    answer(r, u0, Outcome.FAILED, 3)
    clock.now = u0.ejected_until
    reports(r, 4)
    assert u0.capacity == 1 and u0.probation
    assert [r.pick() for _ in range(3)] == [u0, u1, u1]  # one on u0, the rest elsewhere
    r.release(u0, Outcome.FAILED)  # its first failure on probation: out again, for longer
    assert u0.ejections == 2 and ejected_for(u0, clock) == 10.0
    clock.now = u0.ejected_until
    reports(r, 4)
    assert r.pick() is u0
    r.release(u0, Outcome.OK)  # answered: probation ends, its capacity is its own again
    assert u0.capacity == 4 and not u0.probation
    assert [r.pick() for _ in range(4)].count(u0) >= 3
    answer(r, u0, Outcome.FAILED)  # one failure is one failure again
    assert clock.now >= u0.ejected_until


@pytest.mark.parametrize("answer_s", [0.05, 2.0])
def test_a_unit_that_never_answers_takes_under_1_percent_after_the_first_minute(
    answer_s: float,
) -> None:
    # 32 clients loop for 10 virtual minutes over lor. u0 takes requests and never
    # answers while it reports SERVING: each request there fails when the client gives
    # up (gave_up_failure_s) or the response timeout passes, whichever the gateway sees
    # first; u1 answers each request in answer_s. Default ejection settings.
    r, clock = fleet(capacity=16)
    hole, give_up_s = r.units["u0"], 30.0
    start = clock.now
    events: list[tuple[float, int, Unit | None]] = [(start, c, None) for c in range(32)]
    heapq.heapify(events)
    sent = {"u0": 0, "u1": 0}
    seq, report_at = 1, start
    while events:
        at, client, unit = heapq.heappop(events)
        clock.now = at
        while report_at <= at:  # each unit reports what it holds every second
            seq += 1
            for u in r.units.values():
                r.apply_report(u.id, LoadReport(u.id, UnitState.SERVING, u.inflight, 16, seq=seq))
            report_at += 1.0
        if unit is not None:  # its request ended
            r.release(unit, Outcome.FAILED if unit is hole else Outcome.OK)
        if at - start > 600.0:
            continue
        chosen = r.pick()
        if chosen is None:  # every unit it could take is full: it tries again shortly
            heapq.heappush(events, (at + answer_s, client, None))
            continue
        if at - start >= 60.0:
            sent[chosen.id] += 1
        done = at + (give_up_s if chosen is hole else answer_s)
        heapq.heappush(events, (done, client, chosen))
    share = sent["u0"] / (sent["u0"] + sent["u1"])
    assert share <= 0.01, sent
    assert hole.ejections >= 5  # it kept coming back, for longer each time
