"""The gateway's wait queue: requests that no unit can take yet, in fair order.

Order: priority class first (interactive, standard, batch); within a class the tenant
that was served the fewest tokens recently goes first (a virtual token counter, VTC);
within a tenant, arrival order. So a tenant that floods its class waits behind the
light ones of that class, and no class waits behind a lower one.

The counter of a tenant grows by the tokens it is served (``charge``: the router
charges a request's estimate when a unit takes it, corrected when the request ends to
what it used) and halves every ``half_life_s``: "recently" is that. A tenant that starts
waiting after being idle is lifted to the least counter among the tenants already
waiting in its class, so idleness banks no credit to spend in a burst later (VTC's rule).

Bounds: each class has its most waiters (and its longest wait, which the router keeps
with ``max_wait_s``). A new request over its class's bound is refused (``QueueFull``);
with the whole queue at ``max_total``, an interactive one takes the place of the batch
waiter that came last (``push`` returns it, to be answered 429 ``shed``), else it is
refused. A retry or migration (a request a unit took before) is never shed.

``first`` finds the next waiter in that order that a caller's test accepts (the router's:
may it take one of the free units), looking at each waiting tenant of a class once:
O(tenants waiting in that class), and with one tenant (no tenants configured) the head
of one line, as a FIFO.
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from collections.abc import Callable, Collection, Iterator, Sequence

from proxy.errors import Overloaded
from proxy.tenants import PRIORITIES, RANK

INTERACTIVE, BATCH = RANK["interactive"], RANK["batch"]


class QueueFull(Overloaded):
    """No room for the request in the wait queue (its class's bound, or the whole)."""

    def __init__(self, message: str):
        super().__init__(message, retry_after_s=1, code="queue_full")


class Waiter:
    """One request waiting, and the units it must not be given. (A plain class: one per
    waiting request.)"""

    __slots__ = ("arrived", "cost", "exclude", "future", "model", "queued", "rank", "seq",
                 "shed", "sheddable", "tenant")  # fmt: skip

    def __init__(
        self,
        tenant: str,
        rank: int,
        cost: int,
        future: asyncio.Future[None] | None = None,
        exclude: Collection[str] = (),
        model: str | None = None,
    ):
        self.tenant = tenant
        self.rank = rank
        self.cost = cost  # estimated tokens
        self.future = future  # resolved when it may try for a unit (or is shed)
        self.exclude = exclude
        self.model = model
        # Only a request no unit took yet may be shed: a retry or migration never is.
        self.sheddable = not exclude
        self.arrived = 0.0
        self.seq = 0  # its place in line, given by push
        self.queued = False  # in the queue now
        self.shed = False  # taken out to make room for an interactive request

    def __repr__(self) -> str:
        return f"Waiter({self.tenant!r}, {PRIORITIES[self.rank]}, #{self.seq})"

    def again(self, future: asyncio.Future[None]) -> Waiter:
        """The same request waiting again in its old place (``requeue``)."""
        waiter = Waiter(self.tenant, self.rank, self.cost, future, self.exclude, self.model)
        waiter.sheddable = self.sheddable
        waiter.arrived = self.arrived
        waiter.seq = self.seq
        return waiter


class _Served:
    """A tenant's virtual token counter: tokens served, decayed to ``at``."""

    __slots__ = ("at", "value")

    def __init__(self, value: float, at: float):
        self.value = value
        self.at = at


class FairQueue:
    def __init__(
        self,
        max_waiters: Sequence[int],  # by class rank
        max_wait_s: Sequence[float],  # by class rank
        max_total: int,
        half_life_s: float = 60.0,
        clock: Callable[[], float] = lambda: 0.0,
    ):
        self.max_waiters = list(max_waiters)
        self.max_wait_s = list(max_wait_s)
        self.max_total = max_total
        self._half_life_s = half_life_s
        # A count decays by exp(age x this): 0.5 ** (age / half_life_s), one native call
        # where ``**`` of floats is a generic one (compiled).
        self._decay = -math.log(2.0) / half_life_s
        self._clock = clock
        # per class: tenant -> its waiters in arrival order
        self._classes: list[dict[str, deque[Waiter]]] = [{} for _ in PRIORITIES]
        self._counts = [0 for _ in PRIORITIES]
        self.total = 0  # waiters in every class
        self._served: dict[str, _Served] = {}  # tenant -> its counter, while above 0
        self._seq = 0

    def __len__(self) -> int:
        return self.total

    def waiting(self, priority: str) -> int:
        return self._counts[RANK[priority]]

    def tenants_waiting(self, rank: int) -> bool:
        """Whether a request of a tenant waits in class ``rank`` (without tenants every
        request is tenant "")."""
        waiters = self._classes[rank]
        return bool(waiters) and (len(waiters) > 1 or "" not in waiters)

    # -- the virtual token counter -------------------------------------------------------

    def served(self, tenant: str) -> float:
        """Tokens served to ``tenant`` recently (decayed to now)."""
        counter = self._served.get(tenant)
        if counter is None:
            return 0.0
        now = self._clock()
        age = now - counter.at
        if age:
            counter.value *= math.exp(age * self._decay)
            counter.at = now
        return counter.value

    def charge(self, tenant: str, tokens: float) -> None:
        """Count ``tokens`` (negative: a correction) as served to ``tenant``. (Twice a
        request with tenants: ``served`` inline, one clock reading, one lookup.)"""
        now = self._clock()
        counter = self._served.get(tenant)
        if counter is None:
            if tokens >= 1e-3:
                self._served[tenant] = _Served(tokens, now)
            return
        value = counter.value
        age = now - counter.at
        if age:
            value *= math.exp(age * self._decay)
        value += tokens
        if value < 1e-3:  # forgotten: a tenant served long ago costs nothing to keep
            del self._served[tenant]
            return
        counter.value = value
        counter.at = now

    # -- waiting -----------------------------------------------------------------------

    def push(self, waiter: Waiter) -> Waiter | None:
        """Queue a request; returns a batch waiter shed to make room for it (already out
        of the queue, its ``shed`` set: to be answered 429 ``shed``), if one was. Raises
        QueueFull when there is no room."""
        rank = waiter.rank
        if self._counts[rank] >= self.max_waiters[rank]:
            raise QueueFull(f"the wait queue holds its most {PRIORITIES[rank]} requests "
                            f"({self.max_waiters[rank]})")  # fmt: skip
        shed = None
        if self.total >= self.max_total:
            shed = self._last_batch() if rank == INTERACTIVE else None
            if shed is None:
                raise QueueFull(f"every unit is full and {self.total} requests already wait")
            self.remove(shed)
            shed.shed = True
        waiters = self._classes[rank]
        queue = waiters.get(waiter.tenant)
        if queue is None:
            if waiters:
                self._lift(waiter.tenant, waiters)
            queue = waiters[waiter.tenant] = deque()
        self._seq += 1
        waiter.seq = self._seq
        waiter.arrived = self._clock()
        queue.append(waiter)
        waiter.queued = True
        self._counts[rank] += 1
        self.total += 1
        return shed

    def requeue(self, waiter: Waiter) -> None:
        """Put back a waiter that was handed a unit it could not get (another request
        took it first), in its old place and whatever the bounds: it was counted in them."""
        waiters = self._classes[waiter.rank]
        queue = waiters.get(waiter.tenant)
        if queue is None:
            queue = waiters[waiter.tenant] = deque()
        at = next((i for i, w in enumerate(queue) if w.seq > waiter.seq), len(queue))
        queue.insert(at, waiter)
        waiter.queued = True
        self._counts[waiter.rank] += 1
        self.total += 1

    def _lift(self, tenant: str, waiters: dict[str, deque[Waiter]]) -> None:
        floor = min(self.served(t) for t in waiters)
        if self.served(tenant) < floor:
            self._served[tenant] = _Served(floor, self._clock())

    def _last_batch(self) -> Waiter | None:
        last: Waiter | None = None
        for queue in self._classes[BATCH].values():
            for waiter in reversed(queue):
                if waiter.sheddable:
                    if last is None or waiter.seq > last.seq:
                        last = waiter
                    break
        return last

    def order(self, rank: int) -> list[str]:
        """The tenants waiting in class ``rank``, the one to serve first first."""
        waiters = self._classes[rank]
        if len(waiters) < 2:
            return list(waiters)
        return sorted(waiters, key=lambda t: (self.served(t), waiters[t][0].seq))

    def first(self, accept: Callable[[Waiter], bool] | None = None) -> Waiter | None:
        """The next waiter in fair order (that ``accept``s, when given); None if none.
        It stays queued until ``remove``d."""
        for rank, waiters in enumerate(self._classes):
            if not waiters:
                continue
            for tenant in self.order(rank):
                for waiter in waiters[tenant]:
                    if accept is None or accept(waiter):
                        return waiter
        return None

    def pop(self) -> Waiter | None:
        """The next waiter in fair order, taken out; None if none."""
        waiter = self.first()
        if waiter is not None:
            self.remove(waiter)
        return waiter

    def __iter__(self) -> Iterator[Waiter]:
        """Every waiter, in no particular order."""
        for waiters in self._classes:
            for queue in waiters.values():
                yield from queue

    def ahead(self, rank: int) -> Iterator[Waiter]:
        """The waiters of class ``rank`` and the classes above it."""
        for waiters in self._classes[: rank + 1]:
            for queue in waiters.values():
                yield from queue

    def remove(self, waiter: Waiter) -> bool:
        """Take out a waiter (handed a unit, shed, or its client went away); False if
        it was not waiting."""
        if not waiter.queued:
            return False
        waiter.queued = False
        waiters = self._classes[waiter.rank]
        queue = waiters[waiter.tenant]
        if queue[0] is waiter:
            queue.popleft()
        else:
            queue.remove(waiter)
        if not queue:
            del waiters[waiter.tenant]
        self._counts[waiter.rank] -= 1
        self.total -= 1
        return True
