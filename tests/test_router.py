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
