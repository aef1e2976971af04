"""Policy ``random``: a candidate drawn uniformly (a baseline).

Drawn from every unit, those that cannot take a request rejected
(``index.sample_available``); after a few misses, or when the units serve different
models, from a pass over the candidates.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from proxy.gateway.index import sample_available
from proxy.gateway.policies.base import Candidates, Policy, Shared
from proxy.gateway.request import Want
from proxy.gateway.units import LoadView, Unit


def uniform_random(
    candidates: Sequence[Unit], rng: random.Random, turn: int, view: LoadView
) -> Unit | None:
    return rng.choice(candidates) if candidates else None


class UniformRandom(Policy):
    def __init__(self, shared: Shared):
        super().__init__(shared)

    def choose(self, want: Want, candidates: Candidates) -> Unit | None:
        rng, view = self.shared.rng, self.shared.view
        if candidates.model is None:
            drawn = sample_available(candidates.units, 1, candidates.can_take, rng)
            if drawn is not None:
                return uniform_random(drawn, rng, 0, view)
        return uniform_random(candidates.listed(), rng, 0, view)


POLICY = UniformRandom
