"""The routing core on its own: a Router fed reports, on an injected clock, no sleeps."""

from __future__ import annotations

import asyncio
import random

from proxy.gateway.router import Outcome, Router
from proxy.load import LoadReport, UnitState
from proxy.settings import GatewaySettings, UnitTarget


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def router(*ids: str, capacity: int = 1, **settings: object) -> Router:
    targets = [UnitTarget(id=i, http_url=f"http://{i}:1", grpc_target=f"{i}:2") for i in ids]
    r = Router(GatewaySettings(**settings), targets, rng=random.Random(1), clock=Clock())
    for i in ids:
        r.apply_report(i, LoadReport(i, UnitState.SERVING, 0, capacity, seq=1))
    return r


async def settle() -> None:
    for _ in range(3):
        await asyncio.sleep(0)


async def test_a_freed_unit_goes_to_the_first_waiter_that_may_take_it() -> None:
    r = router("a", "b")
    a, b = await r.acquire(), await r.acquire()
    assert {a.id, b.id} == {"a", "b"}
    retried = asyncio.create_task(r.acquire(exclude={"a"}))  # it failed on a: not a again
    newer = asyncio.create_task(r.acquire())
    await settle()
    assert r.waiting == 2
    r.release(r.units["a"], Outcome.OK)
    await settle()
    assert newer.done() and newer.result().id == "a", "the newer request takes the idle unit"
    assert not retried.done()
    r.release(r.units["b"], Outcome.OK)
    await settle()
    assert retried.done() and retried.result().id == "b"


async def test_a_new_request_does_not_queue_behind_one_that_cannot_take_the_free_unit() -> None:
    r = router("a", "b")
    await r.acquire()
    await r.acquire()
    retried = asyncio.create_task(r.acquire(exclude={"a"}))
    await settle()
    r.release(r.units["a"], Outcome.OK)
    await settle()
    unit = await asyncio.wait_for(r.acquire(), 1)  # not behind the waiter that excludes a
    assert unit.id == "a"
    assert not retried.done()
    retried.cancel()


async def test_waiters_keep_their_order() -> None:
    r = router("a")
    await r.acquire()
    first = asyncio.create_task(r.acquire())
    second = asyncio.create_task(r.acquire())
    await settle()
    r.release(r.units["a"], Outcome.OK)
    await settle()
    assert first.done() and not second.done()
    r.release(r.units["a"], Outcome.OK)
    await settle()
    assert second.done()


def test_whether_any_unit_reports_serving_is_kept_as_reports_arrive() -> None:
    r = router("a", "b")
    assert r.any_reported_serving
    r.apply_report("a", LoadReport("a", UnitState.NOT_SERVING, 0, 1, seq=2))
    assert r.any_reported_serving  # b still serves
    r.forget_report("b", "load stream broke")
    assert not r.any_reported_serving
    r.forget_report("b", "load stream broke")  # again: no report to uncount
    r.apply_report("a", LoadReport("a", UnitState.NOT_SERVING, 0, 1, seq=1))  # late: dropped
    assert not r.any_reported_serving
    r.apply_report("b", LoadReport("b", UnitState.SERVING, 0, 1, seq=1))
    assert r.any_reported_serving


def test_the_serving_count_matches_a_pass_over_every_unit() -> None:
    ids = [f"u{i}" for i in range(12)]
    r = router(*ids)
    rng = random.Random(7)
    seqs = dict.fromkeys(ids, 1)
    for _ in range(2_000):
        unit = rng.choice(ids)
        if rng.random() < 0.1:
            r.forget_report(unit, "gone")
        else:
            seqs[unit] += rng.choice((1, 1, 1, -3))  # now and then a late, older report
            state = rng.choice(list(UnitState))
            r.apply_report(unit, LoadReport(unit, state, 0, 1, seq=seqs[unit]))
        assert r.any_reported_serving == any(u.state is UnitState.SERVING for u in r.units.values())
