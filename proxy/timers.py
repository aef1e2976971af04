"""Coarse timers for the gateway's hot path.

Every proxied request needs a timeout (the unit's response time, the request's
deadline) and every kept-alive connection an idle limit, yet almost none of them
fire. An event-loop timer costs about 3 us to arm and cancel, and ``asyncio.timeout``
with a reschedule about 8 us, a tenth of a request's whole cost in the gateway.

``Wheel`` files timers in slots of ``GRAIN_S`` and keeps one loop timer armed, for the
earliest slot. Arming or cancelling a timer is a dict operation; timers with the same
duration land in the same or a later slot, so in steady state no loop timer is armed
per request at all. A timer fires up to one grain late, never early.

``Deadline`` is ``asyncio.timeout_at`` on a wheel: the same cancel-then-TimeoutError
semantics, for the one task that entered it.
"""

from __future__ import annotations

import asyncio
import heapq
import math
import sys
from collections.abc import Callable
from types import TracebackType

GRAIN_S = 0.005

if sys.version_info >= (3, 12):
    from asyncio import current_task as _current_task
else:
    # asyncio.current_task is Python code in CPython 3.11 (C from 3.12): an interpreted
    # call on every request. The table it reads is the C task module's own.
    _CURRENT: dict[asyncio.AbstractEventLoop, asyncio.Task[object]] = vars(asyncio.tasks)[
        "_current_tasks"
    ]

    def _current_task(loop: asyncio.AbstractEventLoop) -> asyncio.Task[object] | None:
        return _CURRENT.get(loop)


class Timer:
    __slots__ = ("callback", "slot")

    def __init__(self, slot: int, callback: Callable[[], object]):
        self.slot = slot
        self.callback = callback


class Wheel:
    def __init__(self, loop: asyncio.AbstractEventLoop, grain_s: float = GRAIN_S):
        self.loop = loop
        self._loop = loop
        self._grain = grain_s
        self._slots: dict[int, dict[Timer, None]] = {}
        self._order: list[int] = []  # slot numbers, a heap; may hold emptied ones
        self._armed: asyncio.TimerHandle | None = None
        self._armed_slot: int | None = None

    def __len__(self) -> int:
        return sum(len(timers) for timers in self._slots.values())

    def call_at(self, when: float, callback: Callable[[], object]) -> Timer:
        """Call ``callback()`` at loop time ``when`` (up to a grain later)."""
        slot = math.ceil(when / self._grain)
        timers = self._slots.get(slot)
        if timers is None:
            timers = self._slots[slot] = {}
            heapq.heappush(self._order, slot)
            if self._armed_slot is None or slot < self._armed_slot:
                self._arm(slot)
        timer = Timer(slot, callback)
        timers[timer] = None
        return timer

    def cancel(self, timer: Timer) -> None:
        timers = self._slots.get(timer.slot)
        if timers is not None:
            timers.pop(timer, None)
            if not timers:
                del self._slots[timer.slot]

    def close(self) -> None:
        """Drop every timer (the loop is going away)."""
        if self._armed is not None:
            self._armed.cancel()
        self._armed = self._armed_slot = None
        self._slots.clear()
        self._order.clear()

    def _arm(self, slot: int) -> None:
        if self._armed is not None:
            self._armed.cancel()
        self._armed_slot = slot
        self._armed = self._loop.call_at(slot * self._grain, self._fire)

    def _fire(self) -> None:
        self._armed = self._armed_slot = None
        now = math.floor(self._loop.time() / self._grain)
        order, slots = self._order, self._slots
        due: list[Timer] = []
        while order and order[0] <= now:
            timers = slots.pop(heapq.heappop(order), None)
            if timers:
                due.extend(timers)
        while order and order[0] not in slots:
            heapq.heappop(order)  # emptied by cancels
        if order:
            self._arm(order[0])
        for timer in due:
            try:
                timer.callback()
            except Exception as exc:  # one failing callback must not stop the others
                self._loop.call_exception_handler(
                    {"message": "timer callback failed", "exception": exc}
                )


class Deadline:
    """``async with Deadline(wheel, when)``: TimeoutError once loop time passes ``when``."""

    __slots__ = ("_cancelling", "_expired", "_task", "_timer", "_wheel", "_when")

    def __init__(self, wheel: Wheel, when: float | None):
        self._wheel = wheel
        self._when = when
        self._timer: Timer | None = None
        self._expired = False
        self._cancelling = 0
        self._task: asyncio.Task[object] | None = None

    def expired(self) -> bool:
        return self._expired

    def reschedule(self, when: float | None) -> None:
        if self._timer is not None:
            self._wheel.cancel(self._timer)
            self._timer = None
        self._when = when
        if when is not None and not self._expired:
            self._timer = self._wheel.call_at(when, self._on_timeout)

    async def __aenter__(self) -> Deadline:
        # With the loop given: without it, current_task asks for the running loop, and
        # CPython checks that with a getpid() system call.
        task = _current_task(self._wheel.loop)
        if task is None:
            raise RuntimeError("Deadline should be used inside a task")
        self._task = task
        self._cancelling = task.cancelling()
        self.reschedule(self._when)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._timer is not None:
            self._wheel.cancel(self._timer)
            self._timer = None
        assert self._task is not None
        if (
            self._expired
            and exc_type is asyncio.CancelledError
            and self._task.uncancel() <= self._cancelling
        ):
            raise TimeoutError from exc

    def _on_timeout(self) -> None:
        assert self._task is not None
        self._timer = None
        if not self._task.done():
            self._task.cancel()
            self._expired = True
