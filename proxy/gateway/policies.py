"""Choosing a unit: pure functions of a snapshot of candidates.

Every policy gets only units that can take a request (``LoadView.available``) and
never looks at anything else, so "can take a request" has one definition; it reads
each unit's load through the router's ``LoadView``.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Sequence

from proxy.gateway.units import LoadView, Unit

# candidates, the router's random generator, its turn (a count of choices), its view
Select = Callable[[Sequence[Unit], random.Random, int, LoadView], Unit | None]


def least_outstanding(
    candidates: Sequence[Unit], rng: random.Random, turn: int, view: LoadView
) -> Unit | None:
    """Least estimated outstanding / capacity; ties broken at random."""
    if not candidates:
        return None
    loads = [view.load(u) for u in candidates]
    lowest = min(loads)
    tied = [u for u, load in zip(candidates, loads, strict=True) if load == lowest]
    return tied[0] if len(tied) == 1 else rng.choice(tied)


def power_of_two(
    candidates: Sequence[Unit], rng: random.Random, turn: int, view: LoadView
) -> Unit | None:
    """Two distinct candidates at random; the less loaded one (a coin toss on a tie)."""
    if len(candidates) < 2:
        return candidates[0] if candidates else None
    a, b = rng.sample(candidates, 2)
    load_a, load_b = view.load(a), view.load(b)
    if load_a == load_b:
        return a if rng.random() < 0.5 else b
    return a if load_a < load_b else b


def round_robin(
    candidates: Sequence[Unit], rng: random.Random, turn: int, view: LoadView
) -> Unit | None:
    return candidates[turn % len(candidates)] if candidates else None


def uniform_random(
    candidates: Sequence[Unit], rng: random.Random, turn: int, view: LoadView
) -> Unit | None:
    return rng.choice(candidates) if candidates else None


def prefix_affinity(
    least: Unit,
    holders: Iterable[Sequence[Unit]],
    view: LoadView,
    mean: float,
    balance: float,
    slack: int,
) -> Unit:
    """Policy ``prefix``: of the units that hold the longest prefix of the prompt
    (``holders``, longest match first), the least loaded one that stays within the
    bound with this request on it: estimated outstanding + 1 at most ``(1 + balance)``
    x the fleet's mean load (``mean``, outstanding over capacity, this request
    counted) x its capacity, plus ``slack`` requests; if none does, the next shorter
    match; if no holder does, ``least`` (lor).

    Bounded load (consistent hashing with bounded loads): no choice puts a unit above
    ``(1 + balance)`` x the mean plus ``slack``; a popular prefix spreads over more
    units as its first ones reach the bound, because the unit that takes the overflow
    holds it from then on.
    """
    ceiling = (1.0 + balance) * mean
    for units in holders:
        best: Unit | None = None
        best_load = 0.0
        for unit in units:
            estimate = view.estimate(unit)
            if estimate + 1 <= ceiling * unit.capacity + slack:
                load = estimate / unit.capacity
                if best is None or load < best_load:
                    best, best_load = unit, load
        if best is not None:
            return best
    return least


POLICIES: dict[str, Select] = {
    "lor": least_outstanding,
    "prefix": least_outstanding,  # when no prefix is known; the router does the rest
    "p2c": power_of_two,
    "round_robin": round_robin,
    "random": uniform_random,
}
