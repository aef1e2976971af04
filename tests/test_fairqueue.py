"""The fair wait queue (proxy/gateway/fairqueue.py) on an injected clock: priority
classes first, then the tenant served the fewest tokens recently (virtual token
counter), then arrival; per-class bounds, shedding batch for interactive, expiry."""

from __future__ import annotations

import pytest

from proxy.gateway.fairqueue import FairQueue, QueueFull, Waiter

CLASSES = ("interactive", "standard", "batch")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def queue(clock: Clock, per_class: int = 100, total: int = 100, wait_s: float = 10.0,
          half_life_s: float = 60.0) -> FairQueue:  # fmt: skip
    return FairQueue(
        {c: per_class for c in CLASSES}, {c: wait_s for c in CLASSES}, total, half_life_s, clock
    )


def drain(q: FairQueue) -> list[Waiter]:
    out = []
    while (w := q.pop()) is not None:
        out.append(w)
    return out


def test_a_higher_class_goes_first_then_arrival() -> None:
    q = queue(Clock())
    q.push("a", "batch", 1)
    q.push("b", "standard", 1)
    q.push("c", "interactive", 1)
    q.push("d", "standard", 1)
    assert [w.tenant for w in drain(q)] == ["c", "b", "d", "a"]


def test_within_a_class_the_tenant_served_least_goes_first() -> None:
    q = queue(Clock())
    for _ in range(4):
        q.push("heavy", "standard", 100)
    for _ in range(3):
        q.push("light", "standard", 10)
    order = [w.tenant for w in drain(q)]
    # heavy first (it came first, both at 0), then light until it has been served as much
    assert order == ["heavy", "light", "light", "light", "heavy", "heavy", "heavy"]


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
    q.push("busy", "standard", 100)
    q.push("busy", "standard", 100)
    q.push("idle", "standard", 100)  # lifted to busy's 1000 as it joins
    assert q.served("idle") == 1000
    # without the lift, idle would go first; with it the two alternate from here
    assert [w.tenant for w in drain(q)] == ["busy", "idle", "busy"]


def test_each_class_has_its_bound() -> None:
    q = queue(Clock(), per_class=2)
    q.push("a", "batch", 1)
    q.push("a", "batch", 1)
    with pytest.raises(QueueFull) as full:
        q.push("b", "batch", 1)
    assert full.value.http_status == 429 and full.value.code == "queue_full"
    q.push("b", "standard", 1)  # another class has room
    assert (len(q), q.waiting("batch"), q.waiting("standard")) == (3, 2, 1)


def test_an_interactive_request_sheds_the_last_batch_waiter_when_full() -> None:
    q = queue(Clock(), total=3)
    first, _ = q.push("a", "batch", 1)
    last, _ = q.push("b", "batch", 1)
    q.push("c", "standard", 1)
    with pytest.raises(QueueFull):
        q.push("d", "standard", 1)  # only interactive sheds
    _, shed = q.push("d", "interactive", 1)
    assert shed is last and len(q) == 3
    assert [w.tenant for w in drain(q)] == ["d", "c", "a"]
    assert not q.remove(first)  # served already
    q.push("x", "standard", 1)
    q.push("y", "standard", 1)
    q.push("z", "standard", 1)
    with pytest.raises(QueueFull):
        q.push("i", "interactive", 1)  # no batch waiter to shed


def test_waiters_past_their_class_wait_expire_and_leavers_are_removed() -> None:
    clock = Clock()
    q = FairQueue({c: 10 for c in CLASSES}, {"interactive": 1.0, "standard": 5.0, "batch": 60.0},
                  10, clock=clock)  # fmt: skip
    i, _ = q.push("a", "interactive", 1)
    s, _ = q.push("a", "standard", 1)
    b, _ = q.push("a", "batch", 1)
    gone, _ = q.push("b", "batch", 1)
    assert q.remove(gone) and not q.remove(gone)
    clock.now += 2
    assert q.expire() == [i]
    clock.now += 4
    assert q.expire() == [s]
    assert drain(q) == [b]
