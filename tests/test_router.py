"""The routing core on its own: a Router fed reports, on an injected clock and a seeded
random generator, no sleeps. Staleness, the herd correction, tie-breaking and the wait
queue here; the large-fleet choosers in test_index.py, the ejection cap in
test_ejection_cap.py, policy prefix in test_prefix_policy.py."""

from __future__ import annotations

import asyncio
import random
import typing
from collections import Counter

import pytest

from proxy.errors import NotFound, Overloaded
from proxy.gateway.policies.lor import least_outstanding
from proxy.gateway.policies.p2c import power_of_two
from proxy.gateway.request import Want
from proxy.gateway.router import NoUnit, Outcome, Router
from proxy.gateway.units import AS_REPORTED, CORRECTED, Unit
from proxy.load import LoadReport, UnitState
from proxy.registry import POLICIES
from proxy.settings import GatewaySettings, UnitTarget
from proxy.tenants import RANK

pytestmark = pytest.mark.timeout(10)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def router(*ids: str, capacity: int = 1, **settings: object) -> Router:
    return fleet(*ids, capacity=capacity, **settings)[0]


def fleet(
    *ids: str, capacity: int = 1, clock: Clock | None = None, **settings: object
) -> tuple[Router, Clock]:
    """A router over SERVING units that reported ``0/capacity`` at the clock's now."""
    clock = clock or Clock()
    targets = [UnitTarget(id=i, http_url=f"http://{i}:1", grpc_target=f"{i}:2") for i in ids]
    r = Router(GatewaySettings(**settings), targets, rng=random.Random(1), clock=clock)
    for i in ids:
        r.apply_report(i, LoadReport(i, UnitState.SERVING, 0, capacity, seq=1))
    return r, clock


def report(r: Router, uid: str, outstanding: int, capacity: int = 10, seq: int = 2,
           state: UnitState = UnitState.SERVING, **fields: object) -> None:  # fmt: skip
    r.apply_report(uid, LoadReport(uid, state, outstanding, capacity, seq=seq, **fields))  # type: ignore[arg-type]


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


async def test_a_full_queue_and_a_long_wait_are_429_with_their_codes() -> None:
    r = router("a", queue_size=1, queue_timeout_s=0)
    await r.acquire()
    with pytest.raises(Overloaded) as timed_out:  # a wait of at most 0 s ends at once
        await asyncio.wait_for(r.acquire(), 1)
    assert timed_out.value.code == "queue_timeout"
    r = router("a", queue_size=1)
    await r.acquire()
    waiting = asyncio.create_task(r.acquire())
    await settle()
    with pytest.raises(Overloaded) as full:
        await r.acquire()
    assert full.value.code == "queue_full"
    waiting.cancel()


async def test_a_client_that_leaves_the_queue_is_no_longer_counted_in_it() -> None:
    r = router("a", queue_size=2)
    await r.acquire()
    first = asyncio.create_task(r.acquire())
    second = asyncio.create_task(r.acquire())
    third = asyncio.create_task(r.acquire())
    await settle()
    assert r.waiting == 2 and isinstance(third.exception(), Overloaded)
    second.cancel()  # the client went away: behind the head of the line, not at it
    await settle()
    assert r.waiting == 1
    again = asyncio.create_task(r.acquire())  # its place is free again: no queue_full
    await settle()
    assert not again.done() and r.waiting == 2
    for task in (first, again):
        task.cancel()
    await settle()
    assert r.waiting == 0


async def test_waiters_get_no_unit_once_the_last_unit_they_could_take_stops() -> None:
    r, clock = fleet("a", "b", queue_timeout_s=5)
    await r.acquire()
    await r.acquire()
    any_unit = asyncio.create_task(r.acquire())
    not_a = asyncio.create_task(r.acquire(exclude={"a"}))
    not_b = asyncio.create_task(r.acquire(exclude={"b"}))
    await settle()
    assert r.waiting == 3
    report(r, "b", 1, 1, state=UnitState.DRAINING)  # b stops: nothing left for not_a
    await settle()
    assert not_a.done() and isinstance(not_a.exception(), NoUnit)
    assert not any_unit.done() and not not_b.done(), "a may still free up for them"
    report(r, "a", 1, 1, seq=3)  # a reports again, still full; then its reports stop
    clock.now += 10.0  # past stale_after_s: no event says so, the queue's tick does
    r.release_stranded()
    await settle()
    for task in (any_unit, not_b):
        assert task.done() and isinstance(task.exception(), NoUnit)
    assert r.waiting == 0


async def test_with_no_unit_serving_a_request_gets_no_unit_at_once() -> None:
    r = router("a", "b")
    await r.acquire()
    with pytest.raises(NoUnit) as excluded:  # b is free, but this retry already failed there
        await r.acquire(exclude={"a", "b"})
    report(r, "b", 0, 1, state=UnitState.NOT_SERVING)
    report(r, "a", 1, 1, state=UnitState.NOT_SERVING)
    with pytest.raises(NoUnit) as none_serving:
        await r.acquire()
    assert excluded.value.code == none_serving.value.code == "no_unit_available"
    assert r.waiting == 0


def want(tenant: str, priority: str = "standard", cost: int = 0) -> Want:
    return Want(tenant=tenant, rank=RANK[priority], cost=cost)


async def served_in_order(r: Router, tasks: list[asyncio.Task[typing.Any]]) -> list[int]:
    """Free unit a once per waiter; the order (indexes into ``tasks``) they get it in."""
    order: list[int] = []
    for _ in tasks:
        r.release(r.units["a"], Outcome.OK)
        await settle()
        done = [i for i, t in enumerate(tasks) if t.done() and i not in order]
        assert len(done) == 1, "one freed slot goes to exactly one waiter"
        order += done
    return order


async def test_the_queue_serves_interactive_then_standard_then_batch() -> None:
    r = router("a")
    await r.acquire()
    tasks = [asyncio.create_task(r.acquire(want=want("t", p)))
             for p in ("batch", "standard", "interactive", "standard", "batch")]  # fmt: skip
    await settle()
    assert r.waiting == 5
    assert await served_in_order(r, tasks) == [2, 1, 3, 0, 4]


async def test_within_a_class_the_tenant_served_fewest_tokens_goes_first() -> None:
    r = router("a")
    await r.acquire()
    heavy = [asyncio.create_task(r.acquire(want=want("heavy", cost=1000))) for _ in range(2)]
    light = [asyncio.create_task(r.acquire(want=want("light", cost=10))) for _ in range(2)]
    await settle()
    # heavy first (it came first, both served nothing); then light, served less, twice
    assert await served_in_order(r, heavy + light) == [0, 2, 3, 1]


async def test_a_unit_taking_a_request_charges_its_tenant_once_and_the_end_settles() -> None:
    r = router("a", capacity=3)
    first = await r.acquire(want=want("t", cost=300))
    assert r.queue.served("t") == 300
    r.release(first, Outcome.FAILED)
    await r.acquire(exclude={"b"}, want=want("t", cost=300))  # a retry: charged once already
    assert r.queue.served("t") == 300
    r.charge("t", 120 - 300)  # it ended having used 120
    assert r.queue.served("t") == 120
    await r.acquire(want=want("", cost=0))  # no tenants: nothing counted
    assert r.queue.served("") == 0


async def test_an_interactive_request_sheds_a_waiting_batch_one_when_the_queue_is_full() -> None:
    r = router("a", queue_size=2)
    await r.acquire()
    batch = [asyncio.create_task(r.acquire(want=want("b", "batch"))) for _ in range(2)]
    await settle()
    with pytest.raises(Overloaded) as full:  # standard does not shed
        await r.acquire(want=want("s", "standard"))
    assert full.value.code == "queue_full"
    interactive = asyncio.create_task(r.acquire(want=want("i", "interactive")))
    await settle()
    shed = batch[1].exception()
    assert isinstance(shed, Overloaded) and shed.code == "shed" and shed.http_status == 429
    assert not batch[0].done() and r.waiting == 2
    r.release(r.units["a"], Outcome.OK)
    await settle()
    assert interactive.done() and interactive.result().id == "a" and not batch[0].done()
    batch[0].cancel()
    await settle()
    assert r.waiting == 0


async def test_each_class_has_its_bound_on_waiters() -> None:
    r = router("a", queue_size=10, queue_class_size={"batch": 1})
    await r.acquire()
    first = asyncio.create_task(r.acquire(want=want("b", "batch")))
    await settle()
    with pytest.raises(Overloaded) as full:
        await r.acquire(want=want("b", "batch"))
    assert full.value.code == "queue_full" and "batch" in str(full.value)
    standard = asyncio.create_task(r.acquire(want=want("s")))  # its class has room
    await settle()
    assert not standard.done() and r.waiting == 2
    for task in (first, standard):
        task.cancel()
    await settle()
    assert r.waiting == 0


async def test_each_class_has_its_bound_on_waiting() -> None:
    r = router("a", queue_timeout_s=5, queue_class_timeout_s={"interactive": 0})
    await r.acquire()
    batch = asyncio.create_task(r.acquire(want=want("b", "batch")))
    with pytest.raises(Overloaded) as timed_out:  # a wait of at most 0 s ends at once
        await asyncio.wait_for(r.acquire(want=want("i", "interactive")), 1)
    assert timed_out.value.code == "queue_timeout"
    await settle()
    assert not batch.done() and r.waiting == 1, "batch waits its own 5 s"
    batch.cancel()
    await settle()
    assert r.waiting == 0


async def test_a_new_request_waits_behind_a_higher_class_that_may_take_the_free_unit() -> None:
    r = router("a", "b")
    await r.acquire()
    await r.acquire()
    retried = asyncio.create_task(r.acquire(exclude={"a"}, want=want("i", "interactive")))
    await settle()
    r.release(r.units["a"], Outcome.OK)  # free, but the waiter may not take a
    await settle()
    assert (await asyncio.wait_for(r.acquire(want=want("b", "batch")), 1)).id == "a"
    r.release(r.units["b"], Outcome.OK)
    await settle()
    assert retried.done() and retried.result().id == "b"


# -- the allowance over capacity for a higher class -------------------------------------


def full(r: Router, uid: str, standard: int, batch: int, headroom: int = 2,
         capacity: int = 4, seq: int = 2) -> None:  # fmt: skip
    """``uid`` reports itself full: ``standard`` and ``batch`` requests of those classes
    (the rest interactive), ``headroom`` over capacity for a higher class."""
    named = {"priority_headroom": float(headroom), "outstanding_standard": float(standard),
             "outstanding_batch": float(batch)}  # fmt: skip
    report(r, uid, capacity, capacity=capacity, seq=seq, named_metrics=named)


async def test_a_full_unit_takes_a_higher_class_over_capacity_and_never_batch() -> None:
    r = router("a")
    full(r, "a", standard=1, batch=3)
    batch = asyncio.create_task(r.acquire(want=want("bulk", "batch")))
    await settle()
    assert not batch.done() and r.waiting == 1, "batch outranks nothing: it waits"
    unit = await asyncio.wait_for(r.acquire(want=want("chat", "interactive")), 1)
    assert unit.id == "a" and r.view.estimate(unit) == 5  # over capacity, by the allowance
    # standard outranks the 3 batch requests: its class and above hold 2 < 4
    assert (await asyncio.wait_for(r.acquire(want=want("s", "standard")), 1)).id == "a"
    late = asyncio.create_task(r.acquire(want=want("chat", "interactive")))
    await settle()
    assert not late.done(), "capacity 4 + headroom 2 reached: it waits"
    r.release(unit, Outcome.OK)  # 5 held again: the interactive waiter goes first
    await settle()
    assert late.done() and late.result().id == "a" and not batch.done()
    batch.cancel()
    await settle()
    assert r.waiting == 0


async def test_requests_ended_since_the_report_may_have_been_its_lower_classes() -> None:
    # The unit reported itself full of batch work, all of it this gateway's; the batch
    # requests end before its next report (reports are coalesced). Standard requests take
    # the freed slots, but a fifth must not go over capacity on the report's batch count:
    # the unit, with no batch left, would refuse it with a 429 unit_at_capacity.
    r = router("a")
    report(r, "a", 0, capacity=4)
    batch = [await asyncio.wait_for(r.acquire(want=want("bulk", "batch")), 1) for _ in range(4)]
    full(r, "a", standard=0, batch=4, seq=3)
    for unit in batch:
        r.release(unit, Outcome.OK)
    for _ in range(4):
        assert (await asyncio.wait_for(r.acquire(want=want("s", "standard")), 1)).id == "a"
    fifth = asyncio.create_task(r.acquire(want=want("s", "standard")))
    await settle()
    assert not fifth.done() and r.waiting == 1, "no batch left to take a slot from: it waits"
    full(r, "a", standard=4, batch=0, seq=4)
    await settle()
    assert not fifth.done(), "the unit's next report says the same"
    fifth.cancel()
    await settle()


async def test_no_allowance_past_what_the_lower_classes_hold_or_without_tenants() -> None:
    r = router("a")
    full(r, "a", standard=0, batch=1, headroom=4)
    assert (await r.acquire(want=want("chat", "interactive"))).id == "a"
    # interactive now holds 4 of the 4 slots: one more would wait in the engine
    late = asyncio.create_task(r.acquire(want=want("chat", "interactive")))
    plain = asyncio.create_task(r.acquire())  # no tenants: no class, no allowance
    await settle()
    assert not late.done() and not plain.done() and r.waiting == 2
    for task in (late, plain):
        task.cancel()
    await settle()


async def test_a_unit_that_grants_no_interactive_counts_only_batch_below_it() -> None:
    r = router("a")
    # no outstanding_standard: a unit without server.resume_secret, whose 4 requests
    # are standard (it grants interactive as standard)
    named = {"priority_headroom": 2.0, "outstanding_batch": 0.0}
    report(r, "a", 4, capacity=4, named_metrics=named)
    waiting = asyncio.create_task(r.acquire(want=want("chat", "interactive")))
    await settle()
    assert not waiting.done()
    report(r, "a", 4, capacity=4, seq=3, named_metrics={**named, "outstanding_batch": 1.0})
    await settle()
    assert waiting.done() and waiting.result().id == "a"


async def test_unsigned_interactive_counts_as_standard_at_the_unit() -> None:
    r = router("a")
    full(r, "a", standard=4, batch=0)
    r.signs_interactive = False  # no server.resume_secret: the unit grants standard
    waiting = asyncio.create_task(r.acquire(want=want("chat", "interactive")))
    await settle()
    assert not waiting.done(), "standard does not outrank the standard work it holds"
    r.signs_interactive = True
    full(r, "a", standard=4, batch=0, seq=3)  # the report wakes the queue
    await settle()
    assert waiting.done() and waiting.result().id == "a"


async def test_a_report_of_room_over_capacity_wakes_a_higher_class_past_batch_waiters() -> None:
    r = router("a")
    full(r, "a", standard=0, batch=0, headroom=2)  # all interactive: no allowance
    batch = [asyncio.create_task(r.acquire(want=want("bulk", "batch"))) for _ in range(2)]
    chat = asyncio.create_task(r.acquire(want=want("chat", "interactive")))
    await settle()
    assert r.waiting == 3
    full(r, "a", standard=0, batch=2, seq=3)  # two of them are batch after all
    await settle()
    assert chat.done() and chat.result().id == "a"
    assert not any(t.done() for t in batch) and r.waiting == 2
    for task in batch:
        task.cancel()
    await settle()


# -- staleness ---------------------------------------------------------------------


def test_a_report_is_trusted_until_stale_after_s_then_the_unit_is_lost() -> None:
    r, clock = fleet("a", "b", capacity=10, stale_after_s=5.0)
    clock.now += 4.999
    assert {u.id for u in r.candidates()} == {"a", "b"}
    report(r, "b", 0)  # b reports again; a stays silent
    clock.now += 0.001
    assert [u.id for u in r.candidates()] == ["b"]  # exactly at the bound: a is out
    assert r.units["a"].view(clock.now, 5.0) == ("LOST", "no load report for 5 s")
    assert r.units["b"].view(clock.now, 5.0) == ("SERVING", None)
    assert r.pick().id == "b"  # type: ignore[union-attr]


def test_while_the_load_source_is_down_reports_do_not_age() -> None:
    r, clock = fleet("a", capacity=10, stale_after_s=5.0)
    clock.now += 3.0
    r.pause_aging()  # Redis is down: the unit did not go silent, our source did
    clock.now += 60.0
    assert [u.id for u in r.candidates()] == ["a"]
    r.resume_aging()  # aging goes on from 3 s old
    clock.now += 1.999
    assert [u.id for u in r.candidates()] == ["a"]
    clock.now += 0.001
    assert r.candidates() == []


def test_an_older_report_that_arrives_late_is_ignored() -> None:
    r, _ = fleet("a", capacity=10)
    report(r, "a", 7, seq=5, timestamp_ms=2000)
    report(r, "a", 1, seq=4, timestamp_ms=1000)  # sent before the one we have
    assert r.units["a"].report.outstanding == 7  # type: ignore[union-attr]
    report(r, "a", 2, seq=1, timestamp_ms=3000)  # seq went back but newer: a restarted sidecar
    assert r.units["a"].report.outstanding == 2  # type: ignore[union-attr]


def test_a_unit_the_source_lost_takes_nothing_until_it_reports_again() -> None:
    r, clock = fleet("a", "b", capacity=10)
    r.forget_report("a", "connection refused by 10.0.0.1")
    assert [u.id for u in r.candidates()] == ["b"]
    assert r.units["a"].view(clock.now, 5.0) == ("LOST", "connection refused")
    report(r, "a", 0, seq=3)
    assert {u.id for u in r.candidates()} == {"a", "b"}


# -- the herd correction -------------------------------------------------------------


def test_the_estimate_corrects_the_report_by_our_own_starts_and_finishes() -> None:
    r, _ = fleet("a", "b", capacity=10)
    report(r, "a", 3)
    report(r, "b", 6)
    a = r.units["a"]
    for _ in range(3):
        assert r.pick() is a  # a is less loaded until our own starts make it 6
    assert a.estimate() == 6 and AS_REPORTED.estimate(a) == 3
    r.release(a, Outcome.OK)
    assert a.estimate() == 5
    report(r, "a", 4, seq=3)  # a fresh report replaces the correction
    assert a.estimate() == 4


def test_the_estimate_never_drops_below_our_own_requests_in_flight() -> None:
    # A stale low report (0) must not make every request herd onto the unit.
    r, _ = fleet("a", capacity=10)
    a = r.units["a"]
    for _ in range(4):
        r.pick()
    report(r, "a", 0, seq=3)  # it was sent before our 4 requests arrived there
    assert a.started_since_report == 0 and a.estimate() == 4


def test_without_the_correction_a_stale_report_herds_every_request_onto_one_unit() -> None:
    # What correct_load (default true) is for: both read from the same reports.
    for correct in (True, False):
        r, _ = fleet("a", "b", capacity=100, correct_load=correct)
        report(r, "a", 0)
        report(r, "b", 6)
        chosen = Counter(r.pick().id for _ in range(12))  # type: ignore[union-attr]
        if correct:  # a takes 6 to even up, then the two share: 9 each
            assert r.units["a"].estimate() == r.units["b"].estimate() == 9, chosen
        else:
            assert chosen == {"a": 12}


def test_a_unit_full_by_the_estimate_is_no_candidate() -> None:
    r, _ = fleet("a", "b", capacity=2)
    a = r.units["a"]
    r.pick(exclude={"b"})
    r.pick(exclude={"b"})
    assert a.estimate() == 2 and [u.id for u in r.candidates()] == ["b"]


# -- tie-breaking and the choosers, on a seeded generator ----------------------------


def units(*loads: tuple[int, int]) -> list[Unit]:
    made = []
    for i, (outstanding, capacity) in enumerate(loads):
        u = Unit(f"u{i}", "", "")
        u.apply(LoadReport(u.id, UnitState.SERVING, outstanding, capacity), 0.0)
        made.append(u)
    return made


def test_least_outstanding_compares_load_over_capacity_and_draws_among_ties() -> None:
    small, big = units((1, 2), (3, 8))
    assert least_outstanding([small, big], random.Random(0), 0, CORRECTED) is big  # 3/8 < 1/2
    tied = units((1, 4), (2, 8), (1, 4), (5, 8))
    rng = random.Random(4)
    chosen = Counter(least_outstanding(tied, rng, 0, CORRECTED).id for _ in range(300))  # type: ignore[union-attr]
    assert set(chosen) == {"u0", "u1", "u2"}  # never u3; each tie drawn
    assert min(chosen.values()) > 50
    assert least_outstanding([], rng, 0, CORRECTED) is None


def test_the_same_seed_makes_the_same_choices() -> None:
    tied = units((0, 4), (0, 4), (0, 4), (0, 4))
    a, b = random.Random(9), random.Random(9)
    first = [least_outstanding(tied, a, 0, CORRECTED).id for _ in range(20)]  # type: ignore[union-attr]
    assert first == [least_outstanding(tied, b, 0, CORRECTED).id for _ in range(20)]  # type: ignore[union-attr]


def test_power_of_two_takes_the_less_loaded_of_two_and_tosses_a_coin_on_a_tie() -> None:
    light, heavy = units((1, 10), (9, 10))
    rng = random.Random(2)
    assert {power_of_two([light, heavy], rng, 0, CORRECTED).id for _ in range(50)} == {"u0"}  # type: ignore[union-attr]
    even = units((3, 10), (3, 10))
    chosen = Counter(power_of_two(even, rng, 0, CORRECTED).id for _ in range(200))  # type: ignore[union-attr]
    assert set(chosen) == {"u0", "u1"} and min(chosen.values()) > 60
    assert power_of_two(even[:1], rng, 0, CORRECTED) is even[0]


def test_every_policy_the_settings_name_has_a_chooser() -> None:
    named = typing.get_args(GatewaySettings.model_fields["policy"].annotation)
    assert set(POLICIES) == set(named)


def test_round_robin_keeps_its_turn_across_a_unit_that_cannot_take_one() -> None:
    r, _ = fleet("a", "b", "c", capacity=10, policy="round_robin")
    report(r, "b", 10)  # b is full
    assert [r.pick().id for _ in range(4)] == ["a", "c", "a", "c"]  # type: ignore[union-attr]


# -- models --------------------------------------------------------------------------


def test_an_unknown_model_is_not_found_and_a_known_one_routes_to_its_units() -> None:
    r, _ = fleet("a", "b", capacity=10)
    report(r, "a", 0, models=("m1",))
    report(r, "b", 0, models=("m2",))
    with pytest.raises(NotFound) as missing:
        r.check_model("m3")
    assert missing.value.code == "model_not_found"
    r.check_model("m2")
    assert [u.id for u in r.candidates(model="m2")] == ["b"]


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
