"""Choosing a unit: pure functions of a snapshot of candidates.

Every policy gets only units that can take a request (``Unit.available``) and never
looks at anything else, so "can take a request" has one definition.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Literal

from proxy.gateway.units import Unit

Policy = Literal["lor", "p2c", "round_robin", "random"]
Select = Callable[[Sequence[Unit], random.Random, int, bool], Unit | None]


def least_outstanding(
    candidates: Sequence[Unit], rng: random.Random, turn: int, correct: bool = True
) -> Unit | None:
    """Least estimated outstanding / capacity; ties broken at random."""
    if not candidates:
        return None
    loads = [u.load(correct) for u in candidates]
    lowest = min(loads)
    tied = [u for u, load in zip(candidates, loads, strict=True) if load == lowest]
    return tied[0] if len(tied) == 1 else rng.choice(tied)


def power_of_two(
    candidates: Sequence[Unit], rng: random.Random, turn: int, correct: bool = True
) -> Unit | None:
    """Two distinct candidates at random; the less loaded one (a coin toss on a tie)."""
    if len(candidates) < 2:
        return candidates[0] if candidates else None
    a, b = rng.sample(candidates, 2)
    load_a, load_b = a.load(correct), b.load(correct)
    if load_a == load_b:
        return a if rng.random() < 0.5 else b
    return a if load_a < load_b else b


def round_robin(
    candidates: Sequence[Unit], rng: random.Random, turn: int, correct: bool = True
) -> Unit | None:
    return candidates[turn % len(candidates)] if candidates else None


def uniform_random(
    candidates: Sequence[Unit], rng: random.Random, turn: int, correct: bool = True
) -> Unit | None:
    return rng.choice(candidates) if candidates else None


POLICIES: dict[str, Select] = {
    "lor": least_outstanding,
    "p2c": power_of_two,
    "round_robin": round_robin,
    "random": uniform_random,
}
