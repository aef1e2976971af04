"""The router's large-fleet choosers against the plain scan, on an injected clock."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from proxy.gateway.router import Outcome, Router
from proxy.gateway.units import Unit
from proxy.load import LoadReport, UnitState
from proxy.settings import GatewaySettings, UnitTarget

STATES = [UnitState.SERVING] * 6 + [UnitState.NOT_SERVING, UnitState.DRAINING]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def fleet(n: int, policy: str, clock: Clock, seed: int = 1, **settings: object) -> Router:
    targets = [UnitTarget(id=f"u{i}", http_url=f"http://u{i}:1", grpc_target=f"u{i}:2")
               for i in range(n)]  # fmt: skip
    s = GatewaySettings(policy=policy, stale_after_s=5, eject_after=2, eject_s=3, **settings)
    return Router(s, targets, rng=random.Random(seed), clock=clock)


def least_by_scan(router: Router, exclude: set[str]) -> float | None:
    loads = [router.view.load(u) for u in router.candidates(exclude)]
    return min(loads) if loads else None


@pytest.mark.parametrize("correct", [True, False])
def test_lor_picks_what_the_scan_would_through_reports_ejections_staleness_and_outages(
    correct: bool,
) -> None:
    clock, rng = Clock(), random.Random(7)
    router = fleet(30, "lor", clock, correct_load=correct)
    held: list[Unit] = []
    seq = 0
    picks = nones = 0
    for step in range(4000):
        op = rng.random()
        if op < 0.3:
            seq += 1
            uid = f"u{rng.randrange(30)}"
            state = rng.choice(STATES)
            capacity = rng.choice([0, 2, 4, 8])
            report = LoadReport(uid, state, rng.randrange(capacity + 1), capacity, seq=seq)
            router.apply_report(uid, report)
        elif op < 0.6:
            exclude = {f"u{rng.randrange(30)}" for _ in range(rng.randrange(3))}
            expected = least_by_scan(router, exclude)
            unit = router.pick(exclude)
            if expected is None:
                assert unit is None, step
                nones += 1
            else:
                assert unit is not None, step
                assert unit.id not in exclude
                # The unit had the least load before it took this request.
                unit.inflight -= 1
                unit.started_since_report -= 1
                assert router.view.load(unit) == expected, step
                unit.inflight += 1
                unit.started_since_report += 1
                held.append(unit)
                picks += 1
        elif op < 0.85 and held:
            outcome = rng.choice([Outcome.OK, Outcome.OK, Outcome.FAILED, Outcome.REFUSED])
            router.release(held.pop(rng.randrange(len(held))), outcome)
        elif op < 0.9:
            router.forget_report(f"u{rng.randrange(30)}", "test")
        elif op < 0.93:
            router.pause_aging()
        elif op < 0.96:
            router.resume_aging()
        else:
            clock.now += rng.choice([0.1, 1.0, 4.0])
    assert picks > 500 and nones > 5  # both ways were exercised


def test_lor_breaks_ties_at_random() -> None:
    clock = Clock()
    router = fleet(10, "lor", clock)
    for i in range(10):
        router.apply_report(f"u{i}", LoadReport(f"u{i}", UnitState.SERVING, 0, 4, seq=1))
    counts: Counter[str] = Counter()
    for _ in range(300):
        unit = router.pick()
        assert unit is not None
        counts[unit.id] += 1
        router.release(unit, Outcome.OK)
    assert len(counts) == 10 and min(counts.values()) > 10


def test_an_ejected_unit_comes_back_when_its_cool_down_ends() -> None:
    clock = Clock()
    router = fleet(2, "lor", clock)
    router.apply_report("u0", LoadReport("u0", UnitState.SERVING, 0, 4, seq=1))
    router.apply_report("u1", LoadReport("u1", UnitState.SERVING, 3, 4, seq=1))
    for _ in range(2):
        unit = router.pick()
        assert unit is not None and unit.id == "u0"
        router.release(unit, Outcome.FAILED)
    picked = router.pick()
    assert picked is not None and picked.id == "u1"  # u0 ejected for 3 s
    router.release(picked, Outcome.OK)
    clock.now += 3.0
    picked = router.pick()
    assert picked is not None and picked.id == "u0"


@pytest.mark.parametrize("policy", ["p2c", "random"])
def test_drawn_policies_take_only_units_that_can_and_find_a_lone_one(policy: str) -> None:
    clock, rng = Clock(), random.Random(3)
    router = fleet(200, policy, clock)
    for i in range(200):  # half full, a quarter not serving, a quarter free
        state = UnitState.NOT_SERVING if i % 4 == 1 else UnitState.SERVING
        outstanding = 8 if i % 2 == 0 else rng.randrange(8)
        router.apply_report(f"u{i}", LoadReport(f"u{i}", state, outstanding, 8, seq=1))
    for _ in range(500):
        expected = {u.id for u in router.candidates()}
        unit = router.pick()
        assert unit is not None and unit.id in expected
        router.release(unit, Outcome.OK)
    for i in range(200):  # now only u7 can take a request
        outstanding = 3 if i == 7 else 8
        router.apply_report(f"u{i}", LoadReport(f"u{i}", UnitState.SERVING, outstanding, 8, seq=2))
    unit = router.pick()
    assert unit is not None and unit.id == "u7"


def test_p2c_prefers_the_less_loaded_of_its_two_draws() -> None:
    clock = Clock()
    router = fleet(100, "p2c", clock)
    for i in range(100):  # u0-u49 nearly full, u50-u99 idle
        outstanding = 7 if i < 50 else 0
        router.apply_report(f"u{i}", LoadReport(f"u{i}", UnitState.SERVING, outstanding, 8, seq=1))
    busy = 0
    for _ in range(1000):
        unit = router.pick()
        assert unit is not None
        busy += int(unit.id[1:]) < 50
        router.release(unit, Outcome.OK)
    # A busy unit wins only when both draws are busy: 1/4 of the time (about 49/198).
    assert 150 < busy < 350


def test_round_robin_takes_each_unit_that_can_in_turn() -> None:
    clock = Clock()
    router = fleet(5, "round_robin", clock)
    for i in range(5):
        state = UnitState.NOT_SERVING if i == 2 else UnitState.SERVING
        router.apply_report(f"u{i}", LoadReport(f"u{i}", state, 0, 8, seq=1))
    order = []
    for _ in range(8):
        unit = router.pick({"u4"} if len(order) == 3 else ())
        assert unit is not None
        order.append(unit.id)
        router.release(unit, Outcome.OK)
    assert order == ["u0", "u1", "u3", "u0", "u1", "u3", "u4", "u0"]
