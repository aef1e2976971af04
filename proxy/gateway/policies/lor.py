"""Policy ``lor`` (the default): the least estimated outstanding / capacity, ties at
random.

It keeps the units in a heap by load (``index.LeastLoaded``), moved at each change of a
unit's load, so a choice costs O(log n) however many units there are; when the units
serve different models, a pass over those serving the request's (``least_outstanding``).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from proxy.gateway.index import LeastLoaded
from proxy.gateway.policies.base import Candidates, Policy, Shared
from proxy.gateway.request import Want
from proxy.gateway.units import LoadView, Unit


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


class LeastOutstanding(Policy):
    def __init__(self, shared: Shared):
        super().__init__(shared)
        self.index = LeastLoaded(shared.rng, shared.view, sums=False)

    def choose(self, want: Want, candidates: Candidates) -> Unit | None:
        if candidates.model is not None:
            return least_outstanding(candidates.listed(), self.shared.rng, 0, self.shared.view)
        c = candidates
        return self.index.least(c.now, c.stale_after_s, c.age_at, c.exclude)

    def moved(self, unit: Unit) -> None:
        self.index.update(unit)


POLICY = LeastOutstanding
