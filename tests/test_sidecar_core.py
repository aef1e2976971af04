"""The sidecar's core on its own: admission, the outstanding count, ``let_go`` and the
deadline scope, on an injected clock and the simulator with no step time; no sleeps.

The wires over it (HTTP, gRPC) and the processes are tested end to end elsewhere.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from engine.base import PRIORITY_RANK, EngineRequest, SamplingParams, TokenDelta
from engine.settings import SimSettings
from engine.sim import SimEngine
from proxy.broadcast import Broadcast
from proxy.errors import DeadlineExceeded, EngineDeadError, Overloaded, Unavailable, UnitFailed
from proxy.load import OUTSTANDING_BATCH, OUTSTANDING_STANDARD, PRIORITY_HEADROOM, UnitState
from proxy.metrics import HealthMetrics, ServingMetrics, UnitMetrics
from proxy.resume import HintKey
from proxy.sidecar.core import Lease, SidecarCore, engine_priority
from proxy.sidecar.health import UnitHealth

pytestmark = pytest.mark.timeout(10)

LIMIT_S = 5.0  # a bound on waits that end at once when the code is right


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Unit:
    core: SidecarCore
    health: UnitHealth
    clock: Clock
    changes: Broadcast
    metrics: ServingMetrics


@pytest.fixture
async def make_unit() -> AsyncIterator[Callable[..., Awaitable[Unit]]]:
    engines: list[SimEngine] = []

    async def make(
        capacity: int = 2,
        serving: bool = True,
        headroom: int | None = None,
        key: HintKey | None = None,
        **sim: Any,
    ) -> Unit:
        knobs = {"decode_step_ms": 0, "prefill_ms_per_token": 0, "decode_ms_per_seq": 0}
        engine = SimEngine(SimSettings(**(knobs | sim)))
        await engine.start()
        engines.append(engine)
        registry, changes, clock = CollectorRegistry(), Broadcast(), Clock()
        health = UnitHealth("u", UnitMetrics(registry), HealthMetrics(registry), changes)
        health.add_node("leader", "leader", "127.0.0.1:1")
        if serving:
            health.set_node("leader", True)
        metrics = ServingMetrics(registry)
        core = SidecarCore(unit_id="u", engine=engine, health=health, metrics=metrics,
                           changes=changes, capacity=capacity, retry_after_s=3,
                           clock=clock, priority_headroom=headroom, resume_key=key)  # fmt: skip
        return Unit(core, health, clock, changes, metrics)

    yield make
    for engine in engines:
        await engine.stop()


def request(max_tokens: int = 4) -> EngineRequest:
    return EngineRequest("r", prompt="hello there", sampling=SamplingParams(max_tokens=max_tokens))


async def discard(delta: object) -> None:
    pass


def duration_sum(metrics: ServingMetrics) -> float:
    value = metrics.registry.get_sample_value(
        "unitproxy_request_duration_seconds_sum", {"route": "completions"}
    )
    assert value is not None
    return value


# -- admission -------------------------------------------------------------------------


async def test_a_unit_that_is_not_serving_admits_nothing(make_unit: Any) -> None:
    unit: Unit = await make_unit(serving=False)
    with pytest.raises(Unavailable) as refused:
        unit.core.admit()
    assert refused.value.code == "starting" and refused.value.http_status == 503
    assert unit.core.outstanding == 0


async def test_admits_up_to_capacity_then_refuses_with_429(make_unit: Any) -> None:
    unit: Unit = await make_unit(capacity=2)
    seen = unit.changes.version
    leases = [unit.core.admit(), unit.core.admit()]
    assert unit.core.outstanding == 2
    assert unit.changes.version == seen + 2  # each admission is announced (load reports)
    with pytest.raises(Overloaded) as full:
        unit.core.admit()
    assert (full.value.code, full.value.retry_after_s) == ("unit_at_capacity", 3)
    leases[0].release()
    assert unit.core.outstanding == 1
    unit.core.admit()  # room again
    assert unit.core.outstanding == 2


INTERACTIVE, STANDARD, BATCH = (PRIORITY_RANK[c] for c in ("interactive", "standard", "batch"))


async def test_a_full_unit_takes_a_higher_class_over_capacity_within_the_headroom(
    make_unit: Any,
) -> None:
    unit: Unit = await make_unit(capacity=4, headroom=2, key=HintKey("s3cret"))
    core = unit.core
    batch = [core.admit(BATCH) for _ in range(3)]
    core.admit(STANDARD)
    with pytest.raises(Overloaded):
        core.admit(BATCH)  # at capacity: batch outranks nothing
    # standard: the classes at or above it hold 1 < 4, so a batch request's slot is its
    standard = core.admit(STANDARD)
    assert core.outstanding == 5
    core.admit(INTERACTIVE)
    assert core.outstanding == 6
    with pytest.raises(Overloaded):
        core.admit(INTERACTIVE)  # capacity + headroom reached
    report = core.report()
    assert report.named_metrics[PRIORITY_HEADROOM] == 2
    assert report.named_metrics[OUTSTANDING_BATCH] == 3
    assert report.named_metrics[OUTSTANDING_STANDARD] == 2
    standard.release()
    for lease in batch:
        lease.release()
    assert core.outstanding == 2 and core.report().named_metrics[OUTSTANDING_BATCH] == 0


async def test_over_capacity_only_while_the_higher_classes_hold_fewer_than_capacity(
    make_unit: Any,
) -> None:
    unit: Unit = await make_unit(capacity=2, headroom=4)
    core = unit.core
    core.admit(BATCH)
    core.admit(INTERACTIVE)
    core.admit(INTERACTIVE)  # over: it takes the batch request's slot in the engine
    with pytest.raises(Overloaded):
        core.admit(INTERACTIVE)  # interactive holds every slot: it would wait in the engine
    assert core.outstanding == 3
    # no server.resume_secret here: it grants no interactive, so a gateway must count
    # standard work as a class it cannot go over (no outstanding_standard)
    named = core.report().named_metrics
    assert named[OUTSTANDING_BATCH] == 1 and OUTSTANDING_STANDARD not in named


async def test_no_headroom_where_set_to_0_or_the_engine_ignores_priority(
    make_unit: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    unit: Unit = await make_unit(capacity=1, headroom=0)
    unit.core.admit(BATCH)
    with pytest.raises(Overloaded):
        unit.core.admit(INTERACTIVE)
    default: Unit = await make_unit(capacity=8)
    assert default.core.headroom == 2  # a quarter of the capacity
    # an engine that does not schedule by priority: the request would queue in its FIFO
    monkeypatch.setattr(default.core.engine, "takes_priority", lambda: False)
    assert default.core.headroom == 0
    assert PRIORITY_HEADROOM not in default.core.report().named_metrics


def test_a_unit_grants_interactive_only_to_a_class_signed_by_a_gateway() -> None:
    key = HintKey("s3cret")
    sig = key.sign_priority("req-1", "interactive")
    assert engine_priority("interactive", sig, "req-1", key) == INTERACTIVE
    assert engine_priority(b"interactive", sig.encode(), b"req-1", key) == INTERACTIVE
    assert engine_priority("interactive", None, "req-1", key) == STANDARD  # unsigned
    assert engine_priority("interactive", sig, "req-2", key) == STANDARD  # another request
    assert engine_priority("interactive", sig, "req-1", HintKey("other")) == STANDARD
    assert engine_priority("interactive", sig, "req-1", None) == STANDARD  # no secret here
    assert engine_priority("interactive", "\u00e9" * 64, "req-1", key) == STANDARD
    assert engine_priority("batch", None, None, None) == BATCH
    assert engine_priority("standard", key.sign_priority("r", "standard"), "r", key) == STANDARD
    assert engine_priority(None, None, None, key) == STANDARD


async def test_a_lease_is_released_once(make_unit: Any) -> None:
    unit: Unit = await make_unit()
    lease = unit.core.admit()
    lease.release()
    lease.release()
    unit.core.finish(lease, "completions")
    assert unit.core.outstanding == 0 and lease.released


async def test_run_releases_its_lease_and_times_it_on_the_injected_clock(make_unit: Any) -> None:
    unit: Unit = await make_unit()
    lease = unit.core.admit()
    unit.clock.now += 0.25  # time the request spends in the engine, by the injected clock
    last = await asyncio.wait_for(unit.core.run(lease, request(4), "completions", discard), LIMIT_S)
    assert last.finish_reason == "length" and last.completion_tokens == 4
    assert unit.core.outstanding == 0 and unit.core.running == 0
    assert duration_sum(unit.metrics) == pytest.approx(0.25)


async def test_a_resumed_request_counts_what_was_delivered_as_output(make_unit: Any) -> None:
    unit: Unit = await make_unit()
    plain = await unit.core.run(unit.core.admit(), request(3), "completions", discard)
    resumed = await unit.core.run(
        unit.core.admit(), request(3), "completions", discard, delivered_tokens=5
    )
    assert resumed.completion_tokens == plain.completion_tokens + 5
    assert resumed.prompt_tokens == plain.prompt_tokens - 5


# -- letting go, and the scope every request runs in -------------------------------


async def started(unit: Unit, **run: Any) -> tuple[Lease, asyncio.Task[TokenDelta]]:
    """A request admitted and running in the engine (which the fixture may hang)."""
    lease, before = unit.core.admit(), unit.core.running
    task = asyncio.create_task(unit.core.run(lease, request(1000), "completions", discard, **run))
    async with asyncio.timeout(LIMIT_S):
        while unit.core.running == before:
            await asyncio.sleep(0)
    return lease, task


async def test_let_go_ends_every_request_in_flight_with_unit_failed(make_unit: Any) -> None:
    unit: Unit = await make_unit(hang_after_requests=0)  # a hung collective: no token comes
    (lease_a, a), (_, b) = await started(unit), await started(unit)
    assert unit.core.let_go("node f1 failed") == 2
    assert unit.core.let_go("again") == 0  # each request is let go of once
    for task in (a, b):
        with pytest.raises(UnitFailed, match="unit u failed: node f1 failed") as failed:
            await asyncio.wait_for(task, LIMIT_S)
        assert failed.value.code == "unit_failed"
    assert lease_a.failure is not None and lease_a.released
    assert unit.core.outstanding == 0 and unit.core.running == 0


async def test_the_unit_turning_not_serving_lets_go(make_unit: Any) -> None:
    unit: Unit = await make_unit(hang_after_requests=0)
    watcher = asyncio.create_task(unit.core.watch_failures())
    try:
        _, task = await started(unit)
        unit.health.set_node("leader", False, "probe failed")
        assert unit.health.state is UnitState.NOT_SERVING
        with pytest.raises(UnitFailed, match=r"NOT_SERVING \(failed: leader\)"):
            await asyncio.wait_for(task, LIMIT_S)
    finally:
        watcher.cancel()
        with pytest.raises(asyncio.CancelledError):
            await watcher


async def test_a_deadline_that_passes_is_deadline_exceeded_not_a_unit_failure(
    make_unit: Any,
) -> None:
    unit: Unit = await make_unit(hang_after_requests=0)
    deadline = asyncio.get_running_loop().time()  # passed already: expires at the first wait
    lease = unit.core.admit()
    with pytest.raises(DeadlineExceeded):
        await asyncio.wait_for(
            unit.core.run(lease, request(), "completions", discard, deadline=deadline), LIMIT_S
        )
    assert lease.failure is None and unit.core.outstanding == 0


async def test_a_dead_engine_inside_the_scope_is_a_unit_failure(make_unit: Any) -> None:
    unit: Unit = await make_unit()
    lease = unit.core.admit()
    with pytest.raises(UnitFailed, match="the engine died: gone"):
        async with unit.core.tracked(lease, None):
            assert unit.core.running == 1
            raise EngineDeadError("gone")
    assert unit.core.running == 0


async def test_a_timeout_of_the_callers_own_passes_through_the_scope(make_unit: Any) -> None:
    unit: Unit = await make_unit()
    lease = unit.core.admit()
    with pytest.raises(TimeoutError):
        async with unit.core.tracked(lease, None):
            raise TimeoutError  # not the request's deadline, not a let_go
    assert lease.failure is None


# -- the watchdog's accounting -------------------------------------------------------


async def test_stalled_for_counts_only_time_with_work_and_no_client_to_wait_on(
    make_unit: Any,
) -> None:
    unit: Unit = await make_unit(capacity=4)
    core, clock = unit.core, unit.clock
    clock.now += 50.0
    assert core.stalled_for() == 0.0  # idle
    core.admit()
    clock.now += 7.0
    assert core.stalled_for() == 7.0  # work and no token for 7 s

    blocked = asyncio.Event()
    release = asyncio.Event()

    async def slow_client(delta: object) -> None:
        blocked.set()
        await release.wait()

    lease = core.admit()
    clock.now += 1.0
    task = asyncio.create_task(core.run(lease, request(1), "completions", slow_client))
    await asyncio.wait_for(blocked.wait(), LIMIT_S)
    # The token came (progress at the injected now); the other request still waits.
    assert core.stalled_for() == 0.0
    clock.now += 3.0
    assert core.stalled_for() == 3.0
    release.set()
    await asyncio.wait_for(task, LIMIT_S)


async def test_a_report_says_what_the_core_counts(make_unit: Any) -> None:
    unit: Unit = await make_unit(capacity=3)
    unit.core.admit()
    first, second = unit.core.report(), unit.core.report()
    assert (first.state, first.outstanding, first.capacity) == (UnitState.SERVING, 1, 3)
    assert second.seq == first.seq + 1
    assert [n.name for n in first.nodes] == ["leader"]
