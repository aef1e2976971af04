"""The fair wait queue (proxy/gateway/fairqueue.py) on an injected clock: priority
classes first, then the tenant served the fewest tokens recently (virtual token
counter), then arrival; per-class bounds, shedding batch for interactive, a waiter put
back keeps its place. The router's use of it: tests/test_router.py."""

from __future__ import annotations

import pytest

from proxy.gateway.fairqueue import FairQueue, QueueFull, Waiter
from proxy.tenants import RANK

CLASSES = ("interactive", "standard", "batch")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def queue(clock: Clock, per_class: int = 100, total: int = 100,
          half_life_s: float = 60.0) -> FairQueue:  # fmt: skip
    return FairQueue([per_class] * 3, [10.0] * 3, total, half_life_s, clock)


def push(q: FairQueue, tenant: str, priority: str, cost: int = 1,
         exclude: tuple[str, ...] = ()) -> tuple[Waiter, Waiter | None]:  # fmt: skip
    waiter = Waiter(tenant, RANK[priority], cost, exclude=exclude)
    return waiter, q.push(waiter)


def serve(q: FairQueue) -> list[Waiter]:
    """Take every waiter in order, each charged its cost as a unit takes it (the router's
    part)."""
    out = []
    while (w := q.pop()) is not None:
        q.charge(w.tenant, w.cost)
        out.append(w)
    return out


def test_a_higher_class_goes_first_then_arrival() -> None:
    q = queue(Clock())
    push(q, "a", "batch")
    push(q, "b", "standard")
    push(q, "c", "interactive")
    push(q, "d", "standard")
    assert [w.tenant for w in serve(q)] == ["c", "b", "d", "a"]


def test_within_a_class_the_tenant_served_least_goes_first() -> None:
    q = queue(Clock())
    for _ in range(4):
        push(q, "heavy", "standard", 100)
    for _ in range(3):
        push(q, "light", "standard", 10)
    order = [w.tenant for w in serve(q)]
    # heavy first (it came first, both at 0), then light until it has been served as much
    assert order == ["heavy", "light", "light", "light", "heavy", "heavy", "heavy"]


def test_one_tenant_is_served_in_arrival_order_like_a_fifo() -> None:
    q = queue(Clock())
    waiters = [push(q, "", "standard", 0)[0] for _ in range(5)]
    assert serve(q) == waiters


def test_served_tokens_fade_with_the_half_life() -> None:
    clock = Clock()
    q = queue(clock, half_life_s=10.0)
    q.charge("a", 800)
    clock.now += 30
    assert q.served("a") == pytest.approx(100)
    q.charge("a", -1000)  # a correction never goes below nothing
    assert q.served("a") == 0


def test_a_tenant_back_from_idle_banks_no_credit() -> None:
    q = queue(Clock())
    q.charge("busy", 1000)
    push(q, "busy", "standard", 100)
    push(q, "busy", "standard", 100)
    push(q, "idle", "standard", 100)  # lifted to busy's 1000 as it joins
    assert q.served("idle") == 1000
    # without the lift, idle would go first; with it the two alternate from here
    assert [w.tenant for w in serve(q)] == ["busy", "idle", "busy"]


def test_each_class_has_its_bound() -> None:
    q = queue(Clock(), per_class=2)
    push(q, "a", "batch")
    push(q, "a", "batch")
    with pytest.raises(QueueFull) as full:
        push(q, "b", "batch")
    assert full.value.http_status == 429 and full.value.code == "queue_full"
    push(q, "b", "standard")  # another class has room
    assert (len(q), q.waiting("batch"), q.waiting("standard")) == (3, 2, 1)


def test_an_interactive_request_sheds_the_last_batch_waiter_when_full() -> None:
    q = queue(Clock(), total=3)
    first, _ = push(q, "a", "batch")
    last, _ = push(q, "b", "batch")
    push(q, "c", "standard")
    with pytest.raises(QueueFull):
        push(q, "d", "standard")  # only interactive sheds
    _, shed = push(q, "d", "interactive")
    assert shed is last and shed.shed and not shed.queued and len(q) == 3
    assert [w.tenant for w in serve(q)] == ["d", "c", "a"]
    assert not q.remove(first)  # served already
    for tenant in "xyz":
        push(q, tenant, "standard")
    with pytest.raises(QueueFull):
        push(q, "i", "interactive")  # no batch waiter to shed


def test_a_retry_or_migration_is_never_shed() -> None:
    q = queue(Clock(), total=2)
    fresh, _ = push(q, "a", "batch")
    moving, _ = push(q, "b", "batch", exclude=("unit-1",))  # a unit had it before
    _, shed = push(q, "i", "interactive")
    assert shed is fresh  # not the later one: that one is a migration
    with pytest.raises(QueueFull):
        push(q, "j", "interactive")
    assert moving.queued and not moving.shed


def test_a_waiter_put_back_keeps_its_place_and_leavers_are_removed() -> None:
    q = queue(Clock(), total=3)
    a, _ = push(q, "t", "standard")
    b, _ = push(q, "t", "standard")
    c, _ = push(q, "t", "standard")
    assert q.pop() is a
    assert q.remove(c) and not q.remove(c) and len(q) == 1
    q.requeue(a)  # it lost the unit it was handed to another request
    assert len(q) == 2 and q.first() is a
    assert serve(q) == [a, b] and len(q) == 0


def test_first_skips_the_waiters_the_test_refuses_in_fair_order() -> None:
    q = queue(Clock())
    i, _ = push(q, "a", "interactive")
    s1, _ = push(q, "b", "standard")
    s2, _ = push(q, "b", "standard")
    assert q.first(lambda w: w is not i) is s1
    assert q.first(lambda w: w.rank == RANK["batch"]) is None
    assert list(q.ahead(RANK["interactive"])) == [i]
    assert sorted(w.seq for w in q) == [i.seq, s1.seq, s2.seq]


def test_it_tells_whether_a_tenant_waits_in_a_class() -> None:
    q = queue(Clock())
    plain, _ = push(q, "", "standard")  # no tenants: every request is tenant ""
    assert not q.tenants_waiting(RANK["standard"])
    chat, _ = push(q, "chat", "standard")
    assert q.tenants_waiting(RANK["standard"]) and not q.tenants_waiting(RANK["interactive"])
    q.remove(plain)
    assert q.tenants_waiting(RANK["standard"])
    q.remove(chat)
    assert not q.tenants_waiting(RANK["standard"])
