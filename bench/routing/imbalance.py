"""How evenly a run spread its requests: every change of every unit's outstanding count.

Each request of the run is outstanding on the unit that answered it (its
``x-unitproxy-unit`` header, which the peer routers pass on too) from when the client
sent it to when its response ended, or to the end of the run if it never did. Sweeping
those starts and ends gives every unit's outstanding count between any two changes,
with nothing polled while the run goes (no load on the host, no sample missed). The
client's times include the router's own hop, a millisecond or less on loopback against
requests that last seconds.

Over the measured window, while the fleet is busy (at least ``busy_per_unit``
requests per unit outstanding: with fewer, one unit always holds more than the mean),
each interval between two changes gives ``max / mean`` of the units' outstanding over
capacity, and the distribution of those values weighted by the interval's duration
gives the p50 and p99 (the p99: the value exceeded 1 % of the busy time).

Beside it, the p99 over the instants a request reached a unit (what routing made,
before departures change it), and the ideal: the same totals spread as evenly as whole requests allow (the
least max/mean of any placement), as a router that could move requests between units
at every instant would. What routing cannot
avoid: one request is a large share of a unit's load when few are outstanding.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from functools import cache


@dataclass(frozen=True, slots=True)
class Imbalance:
    p50: float | None  # time-weighted, over the busy intervals of the window
    p99: float | None
    ideal_p50: float | None  # the same totals, spread as evenly as whole requests allow
    ideal_p99: float | None
    at_arrivals_p99: float | None  # over the instants a request reached a unit, unweighted
    changes: int  # busy intervals measured (one per change of any unit's outstanding)
    busy_s: float  # their total duration


@dataclass(frozen=True, slots=True)
class Span:
    """One request on one unit, in seconds from the run's start."""

    unit: str
    start: float
    end: float  # math.inf: never ended


def measure(
    spans: Iterable[Span],
    capacities: Mapping[str, int],
    start: float,
    end: float,
    busy_per_unit: float,
) -> Imbalance:
    ids = list(capacities)
    caps = [capacities[u] for u in ids]
    slot = {u: i for i, u in enumerate(ids)}
    events: list[tuple[float, int, int]] = []
    for span in spans:
        i = slot.get(span.unit)
        if i is None:
            continue
        events.append((span.start, i, 1))
        if not math.isinf(span.end):
            events.append((span.end, i, -1))
    events.sort()
    counts = [0] * len(ids)
    busy = busy_per_unit * len(ids)
    spread = _even_spread(tuple(caps))
    measured: list[tuple[float, float]] = []  # (max/mean, seconds)
    arrived: list[tuple[float, float]] = []  # (max/mean, 1) as a request reached a unit
    ideal: list[tuple[float, float]] = []
    k = 0
    while k < len(events):
        at, starts = events[k][0], False
        while k < len(events) and events[k][0] == at:  # every change at this instant
            counts[events[k][1]] += events[k][2]
            starts = starts or events[k][2] > 0
            k += 1
        until = events[k][0] if k < len(events) else end
        lo, hi = max(at, start), min(until, end)
        total = sum(counts)
        if hi <= lo or total < busy:
            continue
        ratio = _max_over_mean(counts, caps)
        measured.append((ratio, hi - lo))
        if starts:
            arrived.append((ratio, 1.0))
        ideal.append((spread(total), hi - lo))
    return Imbalance(
        p50=weighted_percentile(measured, 50),
        p99=weighted_percentile(measured, 99),
        ideal_p50=weighted_percentile(ideal, 50),
        ideal_p99=weighted_percentile(ideal, 99),
        at_arrivals_p99=weighted_percentile(arrived, 99),
        changes=len(measured),
        busy_s=sum(seconds for _, seconds in measured),
    )


def _max_over_mean(counts: list[int], caps: list[int]) -> float:
    loads = [n / c for n, c in zip(counts, caps, strict=True)]
    return max(loads) * len(loads) / sum(loads)


def _even_spread(caps: tuple[int, ...]) -> Callable[[int], float]:
    @cache
    def spread(total: int) -> float:
        """The least max/mean of ``total`` whole requests over units of ``caps``: for
        each ceiling k / capacity, the units filled up to it, smallest units first
        (a request on a small unit raises the mean most)."""
        best = math.inf
        order = sorted(range(len(caps)), key=lambda i: caps[i])
        for ceiling in {k / c for c in caps for k in range(1, total + 1)}:
            room = [math.floor(ceiling * c + 1e-9) for c in caps]
            if sum(room) < total:
                continue
            counts, left = [0] * len(caps), total
            for i in order:
                counts[i] = min(room[i], left)
                left -= counts[i]
            best = min(best, _max_over_mean(counts, list(caps)))
        return best

    return spread


def weighted_percentile(values: list[tuple[float, float]], q: float) -> float | None:
    """The smallest value v such that values at most v take q % of the total weight."""
    total = sum(w for _, w in values)
    if total <= 0:
        return None
    target = total * q / 100
    running = 0.0
    for value, weight in sorted(values):
        running += weight
        if running >= target:
            return value
    return max(v for v, _ in values)
