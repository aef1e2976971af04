"""Policy ``p2c``: power of two choices, two candidates drawn at random and the less
loaded of them.

The two are drawn from every unit, those that cannot take a request rejected
(``index.sample_available``), so a choice looks at a few units, not at each; after a
few misses, or when the units serve different models, a pass over the candidates.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from proxy.gateway.index import sample_available
from proxy.gateway.policies.base import Candidates, Policy, Shared
from proxy.gateway.request import Want
from proxy.gateway.units import LoadView, Unit


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


class PowerOfTwo(Policy):
    def __init__(self, shared: Shared):
        super().__init__(shared)

    def choose(self, want: Want, candidates: Candidates) -> Unit | None:
        rng, view = self.shared.rng, self.shared.view
        if candidates.model is None:
            drawn = sample_available(candidates.units, 2, candidates.can_take, rng)
            if drawn is not None:
                return power_of_two(drawn, rng, 0, view)
        return power_of_two(candidates.listed(), rng, 0, view)


POLICY = PowerOfTwo
