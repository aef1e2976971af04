"""A fair wait queue for requests that no unit can take yet (not wired in yet).

Order: priority class first (interactive, standard, batch); within a class the tenant
that was served the fewest tokens recently goes first (a virtual token counter, VTC);
within a tenant, arrival order. So a tenant that floods its class waits behind the
light ones of that class, and no class waits behind a lower one.

The counter of a tenant grows by the tokens it is served (the estimate when its
request leaves the queue, corrected with ``charge`` when the request ends) and halves
every ``half_life_s``: "recently" is that. A tenant that starts waiting after being idle
is lifted to the least counter among the tenants already waiting in its class, so
idleness banks no credit to spend in a burst later (VTC's rule).

Bounds: each class has its most waiters and its longest wait. A new request over its
class's bound is refused (``QueueFull``); with the whole queue at ``max_total``, an
interactive one takes the place of the batch waiter that came last (``push`` returns
it, to be answered 429 ``shed``), else it is refused. ``expire`` takes out the waiters
past their class's longest wait. Choosing the next waiter looks at each waiting tenant
of the top class once: O(tenants waiting in that class).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping

from engine.errors import Overloaded
from proxy.tenants import PRIORITIES, RANK

INTERACTIVE, BATCH = RANK["interactive"], RANK["batch"]


class QueueFull(Overloaded):
    """No room for the request in the wait queue (its class's bound, or the whole)."""

    def __init__(self, message: str):
        super().__init__(message, retry_after_s=1, code="queue_full")


class Waiter:
    """One request waiting. (A plain class: one per waiting request.)"""

    __slots__ = ("arrived", "cost", "rank", "seq", "tenant")

    def __init__(self, tenant: str, priority: str, cost: int, arrived: float, seq: int):
        self.tenant = tenant
        self.rank = RANK[priority]
        self.cost = cost  # estimated tokens: charged to the tenant when it leaves
        self.arrived = arrived
        self.seq = seq

    def __repr__(self) -> str:
        return f"Waiter({self.tenant!r}, {PRIORITIES[self.rank]}, #{self.seq})"


class FairQueue:
    def __init__(
        self,
        max_waiters: Mapping[str, int],  # by class
        max_wait_s: Mapping[str, float],  # by class
        max_total: int,
        half_life_s: float = 60.0,
        clock: Callable[[], float] = lambda: 0.0,
    ):
        self._max_waiters = [max_waiters[p] for p in PRIORITIES]
        self._max_wait_s = [max_wait_s[p] for p in PRIORITIES]
        self._max_total = max_total
        self._half_life_s = half_life_s
        self._clock = clock
        # per class: tenant -> its waiters in arrival order
        self._classes: list[dict[str, deque[Waiter]]] = [{} for _ in PRIORITIES]
        self._counts = [0 for _ in PRIORITIES]
        self._served: dict[str, float] = {}  # tenant -> decayed tokens served
        self._served_at: dict[str, float] = {}  # when its counter was last decayed
        self._seq = 0

    def __len__(self) -> int:
        return sum(self._counts)

    def waiting(self, priority: str) -> int:
        return self._counts[RANK[priority]]

    # -- the virtual token counter -------------------------------------------------------

    def served(self, tenant: str) -> float:
        """Tokens served to ``tenant`` recently (decayed to now)."""
        now = self._clock()
        value = self._served.get(tenant, 0.0)
        if value:
            age = now - self._served_at.get(tenant, now)
            value *= 0.5 ** (age / self._half_life_s)
        self._served[tenant] = value
        self._served_at[tenant] = now
        return value

    def charge(self, tenant: str, tokens: float) -> None:
        """Count ``tokens`` (negative: a correction) as served to ``tenant``."""
        self._served[tenant] = max(0.0, self.served(tenant) + tokens)

    # -- waiting -----------------------------------------------------------------------

    def push(self, tenant: str, priority: str, cost: int) -> tuple[Waiter, Waiter | None]:
        """Queue a request; returns its waiter and a batch waiter shed to make room (to be
        answered 429 ``shed``), if one was. Raises QueueFull when there is no room."""
        rank = RANK[priority]
        if self._counts[rank] >= self._max_waiters[rank]:
            raise QueueFull(f"the wait queue holds its most {priority} requests")
        shed = None
        if len(self) >= self._max_total:
            if rank != INTERACTIVE or not self._counts[BATCH]:
                raise QueueFull("the wait queue is full")
            shed = self._last_batch()
            self.remove(shed)
        waiters = self._classes[rank]
        if tenant not in waiters:
            self._lift(tenant, waiters)
        self._seq += 1
        waiter = Waiter(tenant, priority, cost, self._clock(), self._seq)
        waiters.setdefault(tenant, deque()).append(waiter)
        self._counts[rank] += 1
        return waiter, shed

    def _lift(self, tenant: str, waiters: dict[str, deque[Waiter]]) -> None:
        if waiters:
            floor = min(self.served(t) for t in waiters)
            if self.served(tenant) < floor:
                self._served[tenant] = floor

    def _last_batch(self) -> Waiter:
        return max((q[-1] for q in self._classes[BATCH].values()), key=lambda w: w.seq)

    def pop(self) -> Waiter | None:
        """The next waiter to serve, taken out and its cost charged; None if none."""
        for rank, waiters in enumerate(self._classes):
            if not waiters:
                continue
            tenant = min(waiters, key=lambda t: (self.served(t), waiters[t][0].seq))
            waiter = self._take(rank, tenant)
            self.charge(tenant, waiter.cost)
            return waiter
        return None

    def _take(self, rank: int, tenant: str) -> Waiter:
        queue = self._classes[rank][tenant]
        waiter = queue.popleft()
        if not queue:
            del self._classes[rank][tenant]
        self._counts[rank] -= 1
        return waiter

    def remove(self, waiter: Waiter) -> bool:
        """Take out a waiter that leaves (its client went away, or shed); False if it
        was not waiting."""
        queue = self._classes[waiter.rank].get(waiter.tenant)
        if queue is None or waiter not in queue:
            return False
        queue.remove(waiter)
        if not queue:
            del self._classes[waiter.rank][waiter.tenant]
        self._counts[waiter.rank] -= 1
        return True

    def expire(self) -> list[Waiter]:
        """Take out and return the waiters past their class's longest wait."""
        now = self._clock()
        gone: list[Waiter] = []
        for rank, waiters in enumerate(self._classes):
            limit = self._max_wait_s[rank]
            for queue in list(waiters.values()):
                while queue and now - queue[0].arrived > limit:
                    gone.append(queue[0])
                    self.remove(queue[0])
        return gone
