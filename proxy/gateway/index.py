"""Choosing among thousands of units without looking at each one.

A policy in ``select`` is a function of the list of units that can take a request,
and building that list costs a pass over every unit per request: about 1.5 µs a
unit, so 1.5 ms a request at 1,000 units. The router uses these instead where they
give the same answer:

``LeastLoaded`` (policy ``lor``): the units by estimated load, least first, in a heap.
Every change of a unit's estimate (a request started or finished there, a report)
pushes a new entry and leaves the old one behind, to be dropped when it reaches the
top (lazy deletion; the heap is rebuilt when dead entries outnumber live ones). A
unit that cannot take requests until it reports again (not SERVING, report stale or
forgotten) leaves the heap until that report; an ejected one comes back when its
cool-down ends; one excluded by a retry is set aside for that choice only. The top
live entry that can take a request is the least loaded such unit; ties are broken at
random, with a key drawn at each push that puts the unit at a random place among
about the last len(units) that moved.

``sample_available`` (``p2c``, ``random``): units drawn at random from all, those that
cannot take a request rejected, until enough are found; after a few misses the router
falls back to the full list, so the draw stays uniform over the units that can.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections.abc import Callable, Collection, Sequence

from proxy.gateway.units import CORRECTED, LoadView, Unit

SAMPLE_TRIES = 16  # draws before falling back to the full list

Entry = tuple[float, float, int, Unit]  # load, random tie-break, push number, unit


class LeastLoaded:
    def __init__(self, rng: random.Random, view: LoadView = CORRECTED, sums: bool = True):
        """``sums``: keep the fleet's outstanding and capacity for ``mean_load`` (policy
        prefix); without them each change costs about a tenth less."""
        self._rng = rng
        self._view = view
        self._heap: list[Entry] = []
        self._live: dict[str, int] = {}  # unit id -> push number of its current entry
        self._pushes = itertools.count()
        self._held: list[tuple[float, Unit]] = []  # ejected units, until when
        # Over the live units: their estimated outstanding and capacity, and the sums
        # (policy prefix bounds a unit's load by the fleet's mean).
        self._sums: dict[str, tuple[int, int]] | None = {} if sums else None
        self.outstanding = 0
        self.capacity = 0

    def __len__(self) -> int:
        return len(self._live)

    def update(self, unit: Unit) -> None:
        """The unit's estimate changed (or it may take requests again): re-place it."""
        n = next(self._pushes)
        self._live[unit.id] = n
        # Ties: a random place among about the last len(live) units that moved, so a unit
        # just released does not win its tie again at once (a fresh uniform key would:
        # the keys left behind are the larger ones).
        tie = n + self._rng.random() * len(self._live)
        estimate, capacity = self._view.estimate(unit), unit.capacity
        if self._sums is not None:
            self._count(unit.id, (estimate, capacity))
        load = estimate / capacity if capacity else float("inf")
        heapq.heappush(self._heap, (load, tie, n, unit))
        if len(self._heap) > 2 * len(self._live) + 64:
            self._rebuild()

    def remove(self, unit: Unit) -> None:
        """Until ``update``: the unit takes no requests before it reports again."""
        self._live.pop(unit.id, None)
        if self._sums is not None:
            self._count(unit.id, None)

    def _count(self, unit_id: str, now: tuple[int, int] | None) -> None:
        sums = self._sums
        assert sums is not None
        before = sums.pop(unit_id, None) if now is None else sums.get(unit_id)
        if now is not None:
            sums[unit_id] = now
            self.outstanding += now[0]
            self.capacity += now[1]
        if before is not None:
            self.outstanding -= before[0]
            self.capacity -= before[1]

    def mean_load(self, extra: int = 1) -> float:
        """The live units' estimated outstanding (plus ``extra``) over their capacity:
        the fleet's mean load, weighted by capacity. A unit that went stale counts
        until the heap drops it (when it reaches the top, or reports again)."""
        if self._sums is None:
            raise RuntimeError("this index keeps no sums (LeastLoaded(..., sums=True))")
        return (self.outstanding + extra) / self.capacity if self.capacity > 0 else float("inf")

    def hold(self, unit: Unit, until: float) -> None:
        """Out until ``until`` (ejected), then back at its estimate then."""
        self.remove(unit)
        self._held.append((until, unit))

    def least(
        self,
        now: float,
        stale_after_s: float,
        age_at: float,
        exclude: Collection[str] = (),
    ) -> Unit | None:
        """The least loaded unit that can take a request (``LoadView.available``)."""
        if self._held:
            self._release_held(now)
        heap, live = self._heap, self._live
        skipped: list[Entry] = []
        try:
            while heap:
                load, _, n, unit = heap[0]
                if live.get(unit.id) != n:
                    heapq.heappop(heap)  # an old place of a unit that moved since
                    continue
                if load >= 1.0:
                    return None  # the least loaded is full: so is every unit after it
                if unit.id in exclude:
                    skipped.append(heapq.heappop(heap))  # for this choice only
                elif self._view.available(unit, now, stale_after_s, age_at):
                    return unit
                elif now < unit.ejected_until:
                    self.hold(unit, unit.ejected_until)
                else:
                    self.remove(unit)  # not SERVING or stale: back with its next report
            return None
        finally:
            for entry in skipped:
                heapq.heappush(heap, entry)

    def _release_held(self, now: float) -> None:
        due = [unit for until, unit in self._held if until <= now]
        if due:
            self._held = [(until, unit) for until, unit in self._held if until > now]
            for unit in due:
                self.update(unit)

    def _rebuild(self) -> None:
        live = self._live
        self._heap = [e for e in self._heap if live.get(e[3].id) == e[2]]
        heapq.heapify(self._heap)


def sample_available(
    units: Sequence[Unit], k: int, can_take: Callable[[Unit], bool], rng: random.Random
) -> list[Unit] | None:
    """``k`` distinct units that ``can_take``, drawn uniformly; None after
    ``SAMPLE_TRIES`` draws without them (the caller then looks at every unit)."""
    if len(units) < 2 * k:
        return None
    found: list[Unit] = []
    for _ in range(SAMPLE_TRIES):
        unit = units[rng.randrange(len(units))]
        if all(u is not unit for u in found) and can_take(unit):
            found.append(unit)
            if len(found) == k:
                return found
    return None
