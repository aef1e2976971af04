"""The gateway's coarse timers: never early, at most a grain late, cheap to cancel."""

from __future__ import annotations

import asyncio

import pytest

from proxy.timers import GRAIN_S, Deadline, Wheel

pytestmark = pytest.mark.timeout(10)


@pytest.fixture
async def wheel() -> Wheel:
    w = Wheel(asyncio.get_running_loop())
    yield w  # type: ignore[misc]
    w.close()


async def test_timers_fire_in_order_never_early(wheel: Wheel) -> None:
    loop = asyncio.get_running_loop()
    start = loop.time()
    fired: list[tuple[str, float]] = []
    # Filed out of order: the later one first, then one that needs the wheel re-armed.
    wheel.call_at(start + 0.06, lambda: fired.append(("late", loop.time())))
    wheel.call_at(start + 0.02, lambda: fired.append(("early", loop.time())))
    await asyncio.sleep(0.12)
    assert [name for name, _ in fired] == ["early", "late"]
    assert fired[0][1] >= start + 0.02 and fired[1][1] >= start + 0.06
    assert fired[0][1] < start + 0.06, "fired near its time, not with the later one"
    assert len(wheel) == 0


async def test_a_cancelled_timer_does_not_fire_and_its_slot_goes(wheel: Wheel) -> None:
    loop = asyncio.get_running_loop()
    fired: list[str] = []
    kept = wheel.call_at(loop.time() + 0.03, lambda: fired.append("kept"))
    dropped = wheel.call_at(loop.time() + 0.01, lambda: fired.append("dropped"))
    assert len(wheel) == 2
    wheel.cancel(dropped)
    wheel.cancel(dropped)  # twice is harmless
    assert len(wheel) == 1
    await asyncio.sleep(0.08)
    assert fired == ["kept"]
    wheel.cancel(kept)  # after it fired: harmless


async def test_many_timers_of_one_duration_share_slots(wheel: Wheel) -> None:
    loop = asyncio.get_running_loop()
    start = loop.time() + 30  # 1000 deadlines within one grain, however busy the machine
    timers = [wheel.call_at(start + i * GRAIN_S / 1000, lambda: None) for i in range(1000)]
    assert len(wheel) == 1000
    assert len(wheel._slots) <= 2, "filed within one grain: one slot (two at a boundary)"
    for timer in timers:
        wheel.cancel(timer)
    assert len(wheel) == 0 and not wheel._slots


async def test_a_failing_callback_does_not_stop_the_others(wheel: Wheel) -> None:
    loop = asyncio.get_running_loop()
    errors: list[dict[str, object]] = []
    loop.set_exception_handler(lambda _loop, context: errors.append(context))
    fired: list[int] = []
    when = loop.time() + 0.01

    def boom() -> None:
        raise ValueError("boom")

    wheel.call_at(when, boom)
    wheel.call_at(when, lambda: fired.append(1))
    await asyncio.sleep(0.05)
    loop.set_exception_handler(None)
    assert fired == [1]
    assert isinstance(errors[0]["exception"], ValueError)


async def test_deadline_raises_timeout_error(wheel: Wheel) -> None:
    loop = asyncio.get_running_loop()
    start = loop.time()
    with pytest.raises(TimeoutError):
        async with Deadline(wheel, start + 0.02) as scope:
            await asyncio.sleep(1)
    assert scope.expired()
    assert start + 0.02 <= loop.time() < start + 0.02 + GRAIN_S + 0.2


async def test_deadline_passes_when_the_work_ends_in_time(wheel: Wheel) -> None:
    loop = asyncio.get_running_loop()
    async with Deadline(wheel, loop.time() + 0.05) as scope:
        await asyncio.sleep(0.001)
    assert not scope.expired()
    assert len(wheel) == 0, "its timer is cancelled on the way out"
    async with Deadline(wheel, None) as scope:  # no limit at all
        await asyncio.sleep(0.001)
    assert not scope.expired()


async def test_deadline_reschedule_moves_the_limit(wheel: Wheel) -> None:
    loop = asyncio.get_running_loop()
    async with Deadline(wheel, loop.time() + 0.02) as scope:
        scope.reschedule(loop.time() + 0.2)
        await asyncio.sleep(0.05)  # past the first limit
    assert not scope.expired()
    with pytest.raises(TimeoutError):
        async with Deadline(wheel, None) as scope:
            scope.reschedule(loop.time() + 0.01)
            await asyncio.sleep(1)


async def test_an_outside_cancel_stays_a_cancel(wheel: Wheel) -> None:
    loop = asyncio.get_running_loop()

    async def work() -> None:
        async with Deadline(wheel, loop.time() + 5):
            await asyncio.sleep(1)

    task = asyncio.create_task(work())
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
